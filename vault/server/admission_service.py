"""The Admission service: a job's pinned inputs checked and its run admitted (or replayed
within its team's quota) before the scheduler runs it, answered with the run's proven entry."""

from __future__ import annotations

import asyncio

from vault.errors import InvalidArgument
from vault.ledger.runid import RunInputs
from vault.server.admission import Admitted, Admitter
from vault.server.auth import caller
from vault.server.edge import Service, unary, unary_async
from vault.server.ledger_service import LedgerService
from vault.server.metrics import count_admission
from vault.wire import pinvault_pb2 as pb
from vault.wire import pinvault_pb2_grpc as rpc


class AdmissionService(Service, rpc.AdmissionServicer):
    rpc_service = "Admission"

    def __init__(self, admitter: Admitter, ledger_service: LedgerService) -> None:
        self.admitter = admitter
        self.ledger_service = ledger_service
        self.inline = ledger_service.inline

    @unary_async
    async def Admit(self, request: pb.AdmitRequest) -> pb.AdmitResponse:
        inputs = RunInputs.checked(
            image=request.image, dataset=request.dataset, config=request.config, seed=request.seed
        )
        # The scheduler's usual question, a run admitted before on recently checked inputs, is
        # answered from memory on the loop; re-hashing content or appending waits on a thread.
        if self.inline and not request.replay_of:
            team = _team(caller().team_for(request.team))
            known = self.admitter.known_run(inputs, team)
            # A run id other than the known run's is refused, or found, by the full check.
            if known is not None and request.run_id in ("", known[0].run_id):
                run, full = known
                count_admission(None)
                return self._answer(request, Admitted(full, run.entry, new=False, team=team))
        return await asyncio.to_thread(self._admit, request, inputs)

    def _admit(self, request: pb.AdmitRequest, inputs: RunInputs) -> pb.AdmitResponse:
        who = caller()
        admitted = self.admitter.admit(
            inputs,
            team=_team(who.team_for(request.team)),
            author=who.author(request.author),
            run_id=request.run_id,
            replay_of=request.replay_of,
        )
        return self._answer(request, admitted)

    def _answer(self, request: pb.AdmitRequest, admitted: Admitted) -> pb.AdmitResponse:
        inputs = admitted.inputs
        response = pb.AdmitResponse(
            run_id=inputs.run_id,
            seed=str(inputs.seed),
            inputs=inputs.encode(),
            new=admitted.new,
            lease=admitted.lease,
            team=admitted.team,
            image_blobs=self.admitter.image_blobs(inputs.image),
        )
        self.ledger_service.prove(
            response, [(lambda: response.entry, [admitted.entry])], request.known_size
        )
        return response

    @unary
    def ReleaseReplay(self, request: pb.ReleaseReplayRequest) -> pb.ReleaseReplayResponse:
        who = caller()
        # A scheduler or an administrator may end any team's replay.
        team = None if who.authenticated and who.may("schedule") else who.team_for(request.team)
        self.admitter.release_replay(request.lease, team)
        return pb.ReleaseReplayResponse()


def _team(team: str) -> str:
    if not team or len(team) > 128 or not team.isprintable():
        raise InvalidArgument(f"team must be 1 to 128 printable characters, found {team!r}")
    return team
