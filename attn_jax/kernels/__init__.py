"""The kernels room: every attention core (XLA, cuDNN, splash, Pallas) and the one entry point the
mixers call (entry.py), which chooses the core through kernel_choice."""
