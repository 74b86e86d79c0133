"""Weight quantization: weight-only INT8 (per output channel) and INT4 (group-wise) linear layers."""
