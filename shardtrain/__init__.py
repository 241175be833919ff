"""shardtrain: a compact Llama pipeline trainer on torch.distributed that keeps every
worker's state in a shardstore and never builds the whole model in one place."""
