"""The Llama-family decoder: config, weights pytree, layers and forward pass."""
