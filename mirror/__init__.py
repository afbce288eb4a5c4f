"""S3 peer mirrors: cold copies of every blob on several S3 endpoints, replicated through a
durable queue, verified, recorded as placements in the one placement record, reported on and
repaired."""
