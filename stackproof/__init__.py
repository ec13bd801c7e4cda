"""stackproof: build pinned PyTorch + CUDA images and prove them on the GPUs they will run on."""

__version__ = "0.1.0"
