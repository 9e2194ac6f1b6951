"""Offline batch jobs: JSONL in, JSONL out, durable and resumable."""
