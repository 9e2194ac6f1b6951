"""The meso level: which KV-cache blocks a decode step reads, chosen by entropy and by query."""
