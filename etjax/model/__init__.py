"""The decoder: config, weight tables and pytree, families (architectures), layers, forward pass."""
