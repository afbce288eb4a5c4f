"""The Tokens service: administrators create, list and revoke bearer tokens over gRPC. In local
mode there are no tokens, and each call says so."""

from __future__ import annotations

import logging

from vault.errors import FailedPrecondition
from vault.server.auth import caller
from vault.server.edge import Service, unary
from vault.server.tokens import TokenInfo, TokenStore
from vault.wire import pinvault_pb2 as pb
from vault.wire import pinvault_pb2_grpc as rpc

log = logging.getLogger(__name__)


def _token(info: TokenInfo) -> pb.TokenInfo:
    return pb.TokenInfo(
        token_id=info.token_id,
        name=info.name,
        team=info.team,
        role=info.role,
        created=info.created,
        revoked=info.revoked,
    )


class TokensService(Service, rpc.TokensServicer):
    rpc_service = "Tokens"

    def __init__(self, tokens: TokenStore | None) -> None:
        self._tokens = tokens
        self.inline = False

    @property
    def tokens(self) -> TokenStore:
        if self._tokens is None:
            raise FailedPrecondition(
                'this vault has no tokens: they need auth.mode = "credentials" in the '
                "vault's configuration (local mode serves only its host's one user)"
            )
        return self._tokens

    @unary
    def CreateToken(self, request: pb.CreateTokenRequest) -> pb.CreateTokenResponse:
        info, secret = self.tokens.create(name=request.name, team=request.team, role=request.role)
        log.info(
            "%s created token %s for %s (%s, %s)",
            caller().name,
            info.token_id,
            info.name,
            info.team,
            info.role,
        )
        return pb.CreateTokenResponse(token=_token(info), secret=secret)

    @unary
    def ListTokens(self, request: pb.ListTokensRequest) -> pb.ListTokensResponse:
        return pb.ListTokensResponse(tokens=[_token(t) for t in self.tokens.list()])

    @unary
    def RevokeToken(self, request: pb.RevokeTokenRequest) -> pb.RevokeTokenResponse:
        self.tokens.revoke(request.token_id)
        log.info("%s revoked token %s", caller().name, request.token_id)
        return pb.RevokeTokenResponse()
