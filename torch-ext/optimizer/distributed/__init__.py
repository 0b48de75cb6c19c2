"""Muon for parameters spread over ranks: DTensors (FSDP2, tensor parallel) and DDP-replicated tensors.

The entry point is `step.distributed_muon_update`; `muon.Muon` routes such parameters to it.
"""
