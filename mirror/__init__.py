"""S3 peer mirrors: cold copies of every blob on several S3 endpoints, replicated through a
durable queue, verified, reported on and repaired."""
