"""Running scheduled batches on one device: the paged KV cache and its attention backends, the persistent step
buffers, the CUDA graphs per batch bucket, and the model runner that drives them."""
