"""The paged KV cache: device page pool and host-side page allocation."""
