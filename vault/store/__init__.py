"""The content store's vocabulary: chunk lists and the `BlobStore` protocol every tier
implements, dataset manifests, the cache of file digests, and the server's half of the file
handoff. It knows digests and bytes, nothing of ledgers, servers or runs."""
