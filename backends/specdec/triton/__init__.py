"""NVIDIA Triton Inference Server glue: the decoupled Python-based backend (`model.py`), request
parsing (`request.py`), Prometheus metrics (`metrics.py`), the model repository writer
(`repository.py`) and the tritonserver launcher (`server.py`). Parsing and streaming only: the
model logic lives in the engine."""
