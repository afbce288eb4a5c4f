"""The trust core: entries and their canonical encoding, the Merkle tree and its proofs,
checkpoints in signed notes, the audit, run ids, and the ledger's storage (`db`, `log`).

Everything but `db` and `log` is pure Python on bytes, shared by the server, the client and
`vault verify`; `db` and `log` are the storage, which only the server opens. Nothing here
imports gRPC or another part of the vault."""
