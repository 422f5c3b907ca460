"""The target model: config -> params (and their fused layout) -> layers -> target.forward over a
KV cache, with the sharding rules that place it on a device mesh."""
