{
  description = "Flake for the optimizer kernel (Muon)";

  inputs = {
    # Pinned so that every job of a release (one per build variant, plus the upload) uses the same kernel-builder,
    # and the one whose variant list .github/kernel-builder-variants.toml records. There is no flake.lock yet:
    # move this pin and that file together.
    kernel-builder.url = "github:huggingface/kernels/8ac69fc542a4306eade0759ef7c45b4f2ae57df0";
  };

  outputs =
    { self, kernel-builder, ... }:
    kernel-builder.lib.genKernelFlakeOutputs {
      inherit self;
      path = ./.;
    };
}
