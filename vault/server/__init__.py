"""The vault server: the gRPC services over the ledger and the content store, authentication
and tokens, admission and replay quotas. Only `vault serve` and tests import it."""
