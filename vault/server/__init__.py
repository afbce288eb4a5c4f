"""The vault server: assembly from the config, the gRPC services over the ledger and the content
store, authentication and tokens, admission and replay quotas. Only the host commands (`vault
serve`, `vault tier`, `vault scrub`, `vault mirror`) and tests import it."""
