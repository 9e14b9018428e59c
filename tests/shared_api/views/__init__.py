"""Gateway unit tests, one file per endpoint, against a fake device that speaks the real frame
protocol (gpu_worker/contract/wire.py). No real device, no model: each test checks what the
gateway refuses on its own, what exact request it sends to the device, and that it passes the
device's reply through unchanged."""
