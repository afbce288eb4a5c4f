"""Checkpoints of a framework's training state (JAX pytrees, PyTorch state dicts and
`torch.distributed.checkpoint`) as run checkpoints: every array a blob of its own, named by its
digest, and the checkpoint committed by the run's one checkpoint commit, its manifest last.

    from vault.runs.frameworks.jax import PytreeCheckpoints       # pip install 'pinvault[jax]'
    from vault.runs.frameworks.torch import StateDictCheckpoints  # pip install 'pinvault[torch]'

Nothing here is imported by `vault.runs`: a script that uses neither framework loads neither.
"""
