"""Who may do what. Every call is made by an identity (a name, a team and a role), known from a
bearer token or a client certificate; each RPC needs one permission, and each role
(`vault.config.ROLES`) grants a set of them. The embedded default is local mode: one user, on
loopback or a Unix socket only.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

from vault.config import ROLES
from vault.errors import InvalidArgument, PermissionDenied, Unauthenticated, VaultError

MODES: Final = ("local", "credentials")

# Every RPC the vault serves and the permission it needs; a method missing here is refused.
PERMISSIONS: Final[Mapping[str, str]] = {
    "Store.Put": "write",
    "Store.Get": "read",
    "Store.Stat": "read",
    "Store.FindMissing": "read",
    "Store.VerifyBlobs": "audit",
    "Store.PutBatch": "write",
    "Store.Handoff": "read",
    "Store.Scrub": "admin",
    "Store.DirectPut": "write",
    "Store.FinishDirectPut": "write",
    "Store.DirectGet": "read",
    "Ledger.Pin": "write",
    "Ledger.PinBatch": "write",
    "Ledger.Lookup": "read",
    "Ledger.LookupBatch": "read",
    # The least a Log request needs: what it asks for is checked once it is read
    # (REQUEST_PERMISSIONS).
    "Ledger.Log": "read",
    "Ledger.GetCheckpoint": "read",
    "Ledger.GetInclusionProof": "read",
    "Ledger.GetConsistencyProof": "read",
    "Ledger.GetVerifierKey": "read",
    "Ledger.ReadEntries": "audit",
    "Ledger.ReadCheckpoints": "audit",
    "Admission.Admit": "submit",
    "Admission.ReleaseReplay": "submit",
    "Tokens.CreateToken": "admin",
    "Tokens.ListTokens": "admin",
    "Tokens.RevokeToken": "admin",
}


def _log_permission(request: Any) -> str:
    # A dataset's name is how people and jobs give its digest, so any role that may read may
    # read the `dataset` pins that names resolve from; the log of the whole ledger (runs,
    # admissions, every author's pins) is an audit.
    return "read" if request.kind == "dataset" else "audit"


# Methods whose requests may need more than the method's own permission, by what they ask.
REQUEST_PERMISSIONS: Final[Mapping[str, Callable[[Any], str]]] = {
    "Ledger.Log": _log_permission,
}

TOKEN_PREFIX: Final = "pv_"


@dataclass(frozen=True, slots=True)
class Identity:
    name: str
    team: str
    role: str
    # False in local mode: the one local user, whose claimed author and team are taken as said.
    authenticated: bool = True

    def may(self, permission: str) -> bool:
        return permission in ROLES.get(self.role, frozenset())

    def author(self, claimed: str) -> str:
        """The author recorded on an entry: who authenticated, never who the caller says."""
        return self.name if self.authenticated else claimed

    def team_for(self, claimed: str) -> str:
        """The team a job is admitted for: the caller's own, unless it may admit for any."""
        if not self.authenticated or self.may("schedule"):
            return claimed or self.team
        if claimed and claimed != self.team:
            raise PermissionDenied(
                f"{self.name} belongs to team {self.team!r} and may not act for team {claimed!r}"
            )
        return self.team


LOCAL: Final = Identity("local", "local", "admin", authenticated=False)

CALLER: contextvars.ContextVar[Identity] = contextvars.ContextVar("caller", default=LOCAL)


def caller() -> Identity:
    """The identity of the call being served."""
    return CALLER.get()


# ---------------------------------------------------------------------- certificates


def identity_from_certificate(pem: bytes) -> Identity:
    """A client certificate names its holder: CN the name, O the team, OU the role (as
    `vault keys issue` writes them); the TLS handshake already checked it against the CA."""
    # Imported here: the command's start-up (the Slurm plugin runs it per job) stays quick.
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    cert = x509.load_pem_x509_certificate(pem)

    def one(oid: Any, what: str) -> str:
        values = cert.subject.get_attributes_for_oid(oid)
        if len(values) != 1:
            raise Unauthenticated(f"the client certificate has no single {what}")
        return str(values[0].value)

    role = one(NameOID.ORGANIZATIONAL_UNIT_NAME, "role (OU)")
    if role not in ROLES:
        raise Unauthenticated(f"the client certificate's role {role!r} is not a role")
    return Identity(
        one(NameOID.COMMON_NAME, "name (CN)"), one(NameOID.ORGANIZATION_NAME, "team (O)"), role
    )


# ---------------------------------------------------------------------- the gate


class Authenticator(Protocol):
    """Where bearer tokens are checked (`vault.server.tokens.TokenStore`), and where failed
    credentials are counted per address (its `FailedCredentials`)."""

    def authenticate(self, token: str) -> Identity: ...

    def refused(self, address: str, error: Unauthenticated) -> VaultError: ...


class Gate:
    """Decides, for each call, who is calling and whether they may."""

    def __init__(self, mode: str = "local", tokens: Authenticator | None = None) -> None:
        if mode not in MODES:
            raise InvalidArgument(f"unknown auth mode {mode!r}: expected one of {', '.join(MODES)}")
        if mode == "credentials" and tokens is None:
            raise InvalidArgument("auth mode 'credentials' needs the token store")
        self.mode = mode
        self.tokens = tokens

    def identify(
        self,
        metadata: Sequence[tuple[str, Any]],
        auth_context: Mapping[str, Any],
        *,
        address: str = "",
    ) -> Identity:
        """Who is calling. A credential that fails is counted against the caller's `address`
        (`failed_credentials.caller_address`); past the address's allowance it is refused as
        QuotaExceeded rather than Unauthenticated. A valid credential is never counted."""
        if self.mode == "local":
            return LOCAL
        assert self.tokens is not None
        try:
            return self._identify(metadata, auth_context)
        except Unauthenticated as exc:
            raise self.tokens.refused(address, exc) from None

    def _identify(
        self, metadata: Sequence[tuple[str, Any]], auth_context: Mapping[str, Any]
    ) -> Identity:
        for key, value in metadata:
            if key == "authorization":
                text = value.decode() if isinstance(value, bytes) else str(value)
                scheme, _, token = text.partition(" ")
                if scheme.lower() != "bearer" or not token.strip():
                    raise Unauthenticated("the authorization header is not 'Bearer <token>'")
                assert self.tokens is not None
                return self.tokens.authenticate(token.strip())
        pem = auth_context.get("x509_pem_cert")
        if pem:
            return identity_from_certificate(pem[0])
        raise Unauthenticated(
            "this vault needs a credential: a bearer token (client.token_file) or a client "
            "certificate (client.cert_file)"
        )

    def check(
        self,
        rpc: str,
        metadata: Sequence[tuple[str, Any]],
        auth_context: Mapping[str, Any],
        *,
        address: str = "",
    ) -> Identity:
        return self.permit(rpc, self.identify(metadata, auth_context, address=address))

    def permit(self, rpc: str, identity: Identity) -> Identity:
        """`identity`, after checking it may call `rpc`."""
        permission = PERMISSIONS.get(rpc)
        if permission is None or not identity.may(permission):
            roles = [r for r, p in ROLES.items() if permission in p]
            raise PermissionDenied(
                f"{identity.name} ({identity.role}) may not call {rpc}: it needs one of the "
                f"roles {', '.join(roles) or 'none'}"
            )
        return identity

    def permit_request(self, rpc: str, identity: Identity, request: Any) -> None:
        """Refuse a request of `rpc` that asks for more than `identity` may see, once read."""
        rule = REQUEST_PERMISSIONS.get(rpc)
        if rule is None or not identity.authenticated:
            return
        permission = rule(request)
        if not identity.may(permission):
            roles = [r for r, p in ROLES.items() if permission in p]
            raise PermissionDenied(
                f"{identity.name} ({identity.role}) may not call {rpc} but for dataset pins: "
                f"the whole log needs one of the roles {', '.join(roles)}"
            )
