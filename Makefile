# The two commands a newcomer needs: `make demo` and `make test`. Both set everything up.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export HF_HUB_DISABLE_TELEMETRY := 1

.PHONY: demo test build bench quality clean

$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt
	touch $@

build: $(VENV)/.installed
	$(PY) tools/build.py

demo: build
	$(PY) examples/train_gpt.py

test: build
	$(PY) -m pytest -q tests

# muon-fsdp2 is a peer measured beside us in the dist rows; --no-deps keeps the pinned torch.
bench: build
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps muon-fsdp2==0.3.0
	$(PY) benchmarks/bench.py
	$(PY) benchmarks/scale_predictions.py

# AdamW and the Muon variants on the demo GPT over one lr grid and two seeds (7 optimizers x 6 lrs x 2 seeds =
# 84 runs: about 70 minutes on 2 CPU cores).
quality: build
	$(PY) benchmarks/quality.py

clean:
	rm -rf build .build-cache
