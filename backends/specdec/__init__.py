"""specdec: speculative decoding served through NVIDIA Triton Inference Server."""
