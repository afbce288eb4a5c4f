"""Who may do what, against a real `vault serve`: with auth.mode = 'credentials' every call
needs a bearer token or a client certificate, each role may do only its part, entries carry the
authenticated identity, and no secret ever shows in an error or a log. Local mode, the
embedded default, asks for nothing but serves only loopback or a Unix socket."""

from __future__ import annotations

import hashlib
import stat
from pathlib import Path

import grpc
import pytest

from tests.conftest import StartVault
from tests.services.vault_server import VaultServer, run_vault
from vault.client import Credentials, VaultClient
from vault.errors import PermissionDenied, Unauthenticated, Unavailable
from vault.server.auth import PERMISSIONS
from vault.store.manifest import FileEntry, build_manifest, encode_manifest
from vault.wire import pinvault_pb2 as pb

CREDENTIALS = {"PINVAULT_AUTH_MODE": "credentials"}


def first_admin_token(server: VaultServer) -> str:
    """The vault's first administrator token, written offline into its database."""
    created = run_vault(
        "token",
        "create",
        "--offline",
        "--name",
        "root",
        "--team",
        "ops",
        "--role",
        "admin",
        env={"PINVAULT_DATA_DIR": str(server.data_dir), **CREDENTIALS},
        state_home=server.state_home,
    ).ok()
    return created.stdout.strip()


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class Vault:
    """A vault that asks for credentials, with its first administrator token."""

    def __init__(self, server: VaultServer) -> None:
        self.server = server
        self.admin_token = first_admin_token(server)
        self.admin = self.client(self.admin_token)
        self.secrets = [self.admin_token]

    def client(self, token: str = "", **tls: bytes) -> VaultClient:
        return VaultClient(
            self.server.address, credentials=Credentials(token=token, **tls), timeout=60
        )

    def token(self, name: str, team: str, role: str) -> str:
        _, secret = self.admin.create_token(name=name, team=team, role=role)
        self.secrets.append(secret)
        return secret

    def as_(self, name: str, team: str, role: str) -> VaultClient:
        return self.client(self.token(name, team, role))


@pytest.fixture
def vault(start_vault: StartVault) -> Vault:
    return Vault(start_vault(env=CREDENTIALS))


def test_every_rpc_needs_a_named_permission() -> None:
    served = {
        f"{service.name}.{method.name}"
        for service in pb.DESCRIPTOR.services_by_name.values()
        for method in service.methods
    }
    assert served == set(PERMISSIONS)


def test_a_call_without_a_credential_is_unauthenticated(vault: Vault) -> None:
    anonymous = vault.client()
    with pytest.raises(Unauthenticated, match="needs a credential"):
        anonymous.put(b"x")
    with pytest.raises(Unauthenticated):
        anonymous.checkpoint()
    with pytest.raises(Unauthenticated, match="not a pinvault token"):
        vault.client("hunter2").stat(sha256(b"x"))
    forged = vault.admin_token[:-4] + "0000"
    with pytest.raises(Unauthenticated, match="unknown or revoked") as caught:
        vault.client(forged).stat(sha256(b"x"))
    assert forged.rpartition("_")[2] not in str(caught.value)


def test_each_role_may_do_its_part_only(vault: Vault) -> None:
    reader = vault.as_("bob", "vision", "reader")
    writer = vault.as_("alice", "vision", "writer")
    auditor = vault.as_("eve", "audit", "auditor")

    digest = str(writer.put(b"weights").blob.sha256)
    writer.pin("artefact", digest)
    assert reader.stat(digest).blob.size == 7
    assert [p.entry.kind for p in reader.lookup(digest)] == ["artefact"]

    with pytest.raises(PermissionDenied, match=r"bob \(reader\) may not call Store\.Put"):
        reader.put(b"more")
    with pytest.raises(PermissionDenied, match=r"may not call Ledger\.Pin"):
        reader.pin("artefact", digest)
    with pytest.raises(PermissionDenied, match=r"may not call Ledger\.Log"):
        list(reader.log())
    with pytest.raises(PermissionDenied, match=r"may not call Tokens\.CreateToken"):
        writer.create_token(name="x", team="vision", role="admin")
    with pytest.raises(PermissionDenied, match=r"may not call Store\.Put"):
        auditor.put(b"x")

    report = auditor.audit()
    assert report.ok and report.entries == 1
    assert [e.kind for e in auditor.log()] == ["artefact"]


def test_an_entry_carries_the_authenticated_identity(vault: Vault) -> None:
    claiming = VaultClient(
        vault.server.address,
        author="mallory@elsewhere",
        credentials=Credentials(token=vault.token("alice", "vision", "writer")),
        timeout=60,
    )
    digest = str(claiming.put(b"model").blob.sha256)
    assert claiming.pin("artefact", digest).entry.author == "alice"
    assert vault.admin.lookup(digest)[0].entry.author == "alice"


def test_the_first_admin_token_is_made_before_the_vault_ever_ran(
    clean_environment: None, tmp_path: Path
) -> None:
    # An operator's first steps on a new host: the administrator's token, then `vault serve`.
    server = VaultServer(tmp_path / "new", env=CREDENTIALS)
    assert not server.data_dir.exists()
    secret = first_admin_token(server)
    assert stat.S_IMODE(server.data_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((server.data_dir / "vault.db").stat().st_mode) == 0o600
    with server:
        admin = VaultClient(server.address, credentials=Credentials(token=secret), timeout=60)
        with admin:
            (root,) = admin.list_tokens()
            assert (root.name, root.team, root.role) == ("root", "ops", "admin")
            admin.put(b"the first blob of a new vault")


def test_a_revoked_token_is_refused(vault: Vault) -> None:
    secret = vault.token("carol", "vision", "writer")
    carol = vault.client(secret)
    carol.put(b"before")
    token_id = secret.split("_")[1]
    listed = {t.token_id: t for t in vault.admin.list_tokens()}
    assert listed[token_id].name == "carol" and not listed[token_id].revoked

    vault.admin.revoke_token(token_id)
    with pytest.raises(Unauthenticated, match=f"token pv_{token_id} is unknown or revoked"):
        carol.put(b"after")
    assert {t.token_id: t for t in vault.admin.list_tokens()}[token_id].revoked


def test_teams_admit_their_own_jobs_and_schedulers_any(vault: Vault) -> None:
    writer = vault.as_("alice", "vision", "writer")
    image = str(writer.put(b"image").blob.sha256)
    writer.pin("image", image)
    dataset = str(writer.put(encode_manifest(build_manifest([]))).blob.sha256)
    writer.pin("dataset", dataset)

    own = writer.admit(image=image, dataset=dataset, seed=1)
    assert own.entry.entry.meta["team"] == "vision" and own.entry.entry.author == "alice"
    with pytest.raises(PermissionDenied, match="team 'vision' and may not act for team 'speech'"):
        writer.admit(image=image, dataset=dataset, seed=2, team="speech")

    scheduler = vault.as_("slurmctld", "ops", "scheduler")
    theirs = scheduler.admit(image=image, dataset=dataset, seed=3, team="speech")
    assert theirs.entry.entry.meta["team"] == "speech"
    assert theirs.entry.entry.author == "slurmctld"
    with pytest.raises(PermissionDenied, match=r"may not call Store\.Put"):
        scheduler.put(b"x")


def test_secrets_never_show_in_logs_errors_or_the_database(vault: Vault) -> None:
    writer_secret = vault.token("alice", "vision", "writer")
    vault.client(writer_secret).put(b"x")
    token_id = writer_secret.split("_")[1]
    revoked = vault.server.run(
        "token", "revoke", f"pv_{token_id}", "--json",
        env={"PINVAULT_CLIENT_TOKEN": vault.admin_token},
    )  # fmt: skip
    assert revoked.ok().json() == {"token_id": token_id, "revoked": True}
    with pytest.raises(Unauthenticated) as caught:
        vault.client(writer_secret).put(b"y")
    admin = {"PINVAULT_CLIENT_TOKEN": vault.admin_token}
    shown = vault.server.run("token", "list", env=admin)
    listed = vault.server.run("token", "list", "--json", env=admin).ok().json()
    assert [(t["name"], t["revoked"] != "") for t in listed] == [("root", False), ("alice", True)]
    # The database's files, and its subject index's runs beside it.
    files = [
        f
        for p in vault.server.data_dir.glob("vault.db*")
        for f in [p, *p.rglob("*")]
        if f.is_file()
    ]
    stored = b"".join(f.read_bytes() for f in files)
    for secret in vault.secrets:
        hidden = secret.rpartition("_")[2]
        assert hidden not in str(caught.value)
        assert hidden not in shown.ok().stdout + shown.stderr
        assert hidden not in vault.server.log()
        assert hidden.encode() not in stored


def test_local_mode_serves_only_loopback(tmp_path: Path) -> None:
    run = run_vault(
        "serve",
        "--listen",
        "0.0.0.0:0",
        env={"PINVAULT_DATA_DIR": str(tmp_path / "data")},
        state_home=tmp_path,
    )
    assert "auth.mode 'local' asks no credential" in run.error_line()
    assert not (tmp_path / "data").exists(), "a refused server left a data folder behind"


def test_local_mode_asks_for_nothing(vault_server: VaultServer) -> None:
    assert "access: local mode" in "\n".join(vault_server.banner)
    with VaultClient(vault_server.address, author="ada@laptop", timeout=60) as client:
        digest = str(client.put(b"local").blob.sha256)
        # With no credential the one local user writes, and its own name is recorded.
        assert client.pin("artefact", digest).entry.author == "ada@laptop"
        assert client.stat(digest).blob.size == 5


# -- mutual TLS -----------------------------------------------------------------------------


def keys(tmp_path: Path) -> Path:
    folder = tmp_path / "keys"
    # 0.0.0.0 too: the address a server listening on every interface reports.
    made = run_vault(
        "keys", "init", str(folder), "--host", "0.0.0.0", "--json", state_home=tmp_path
    ).ok()
    assert made.json()["server_cert"] == str(folder / "server.pem")
    assert made.json()["hosts"][:2] == ["0.0.0.0", "localhost"]
    for name, team, role in [("dana", "vision", "writer"), ("sam", "ops", "reader")]:
        issued = run_vault(
            "keys", "issue", str(folder), "--name", name, "--team", team, "--role", role,
            "--json", state_home=tmp_path,
        ).ok()  # fmt: skip
        assert issued.json() == {
            "name": name,
            "team": team,
            "role": role,
            "cert": str(folder / f"{name}.pem"),
            "key": str(folder / f"{name}.key"),
        }
    assert (folder / "ca.key").stat().st_mode & 0o777 == 0o600
    assert (folder / "dana.key").stat().st_mode & 0o777 == 0o600
    return folder


def test_mutual_tls_names_the_caller_by_its_certificate(
    start_vault: StartVault, tmp_path: Path
) -> None:
    folder = keys(tmp_path)
    server = start_vault(
        env={
            **CREDENTIALS,
            "PINVAULT_AUTH_TLS_CERT": str(folder / "server.pem"),
            "PINVAULT_AUTH_TLS_KEY": str(folder / "server.key"),
            "PINVAULT_AUTH_CLIENT_CA": str(folder / "ca.pem"),
        },
        channel_credentials=grpc.ssl_channel_credentials(
            root_certificates=(folder / "ca.pem").read_bytes(),
            private_key=(folder / "sam.key").read_bytes(),
            certificate_chain=(folder / "sam.pem").read_bytes(),
        ),
    )
    ca = (folder / "ca.pem").read_bytes()

    def as_(name: str) -> VaultClient:
        return VaultClient(
            server.address,
            credentials=Credentials(
                ca=ca,
                cert=(folder / f"{name}.pem").read_bytes(),
                key=(folder / f"{name}.key").read_bytes(),
            ),
            timeout=20,
        )

    dana = as_("dana")
    digest = str(dana.put(b"over TLS").blob.sha256)
    assert dana.pin("artefact", digest).entry.author == "dana"
    with pytest.raises(PermissionDenied, match=r"sam \(reader\) may not call Store\.Put"):
        as_("sam").put(b"x")
    assert as_("sam").stat(digest).blob.size == 8

    # Without a certificate the handshake fails; without TLS nothing is understood.
    no_certificate = VaultClient(server.address, credentials=Credentials(ca=ca), timeout=5)
    with pytest.raises(Unavailable):
        no_certificate.stat(digest)
    with pytest.raises(Unavailable):
        VaultClient(server.address, timeout=5).stat(digest)

    # The command reads the same files from its config.
    shown = server.run(
        "stat",
        digest,
        env={
            "PINVAULT_CLIENT_CA_FILE": str(folder / "ca.pem"),
            "PINVAULT_CLIENT_CERT_FILE": str(folder / "sam.pem"),
            "PINVAULT_CLIENT_KEY_FILE": str(folder / "sam.key"),
        },
    )
    assert digest in shown.ok().stdout


# -- credentials cross the network only inside TLS -----------------------------------------


def test_credentials_off_loopback_need_tls(tmp_path: Path) -> None:
    run = run_vault(
        "serve",
        "--listen",
        "0.0.0.0:0",
        env={"PINVAULT_DATA_DIR": str(tmp_path / "data"), **CREDENTIALS},
        state_home=tmp_path,
    )
    line = run.error_line()
    assert "would send bearer tokens in plain text" in line and "auth.tls_cert" in line, line
    assert not (tmp_path / "data").exists(), "a refused server left a data folder behind"


def test_plaintext_credentials_off_loopback_are_an_opt_out_logged_loudly(
    start_vault: StartVault,
) -> None:
    server = start_vault(
        listen="0.0.0.0:0",
        env={**CREDENTIALS, "PINVAULT_SERVER_ALLOW_PLAINTEXT_CREDENTIALS": "true"},
    )
    assert "SERVING CREDENTIALS IN PLAIN TEXT on 0.0.0.0:0" in server.log()
    with pytest.raises(Unauthenticated):
        VaultClient(server.address, timeout=10).checkpoint()


def start_tls_vault(
    start_vault: StartVault, tmp_path: Path, **env: str
) -> tuple[VaultServer, bytes]:
    """A vault asking for credentials over TLS on every interface (with `env` besides), and
    the CA its certificate is issued by."""
    folder = keys(tmp_path)
    ca = (folder / "ca.pem").read_bytes()
    server = start_vault(
        listen="0.0.0.0:0",
        env={
            **CREDENTIALS,
            "PINVAULT_AUTH_TLS_CERT": str(folder / "server.pem"),
            "PINVAULT_AUTH_TLS_KEY": str(folder / "server.key"),
            **env,
        },
        channel_credentials=grpc.ssl_channel_credentials(root_certificates=ca),
    )
    return server, ca


def test_bearer_tokens_over_tls_off_loopback(start_vault: StartVault, tmp_path: Path) -> None:
    server, ca = start_tls_vault(start_vault, tmp_path)
    assert "access: credentials, TLS" in "\n".join(server.banner)
    admin = VaultClient(
        server.address, credentials=Credentials(token=first_admin_token(server), ca=ca), timeout=20
    )
    digest = str(admin.put(b"over TLS with a token").blob.sha256)
    assert admin.pin("artefact", digest).entry.author == "root"
    # No token: refused; no TLS: nothing is understood.
    with pytest.raises(Unauthenticated, match="needs a credential"):
        VaultClient(server.address, credentials=Credentials(ca=ca), timeout=10).stat(digest)
    with pytest.raises(Unavailable):
        VaultClient(server.address, timeout=5).stat(digest)


def test_a_writer_resolves_dataset_names_but_may_not_read_the_whole_log(vault: Vault) -> None:
    writer_token = vault.token("alice", "vision", "writer")
    writer = vault.client(writer_token)
    data = b"x,y\n1,2\n"
    entry = FileEntry("train.csv", len(data), 0o644, str(writer.put(data).blob.sha256))
    manifest = str(writer.put(encode_manifest(build_manifest([entry]))).blob.sha256)
    writer.pin("dataset", manifest, meta={"name": "mnist", "tag": "v1"})
    env = {"PINVAULT_CLIENT_TOKEN": writer_token}

    shown = vault.server.run("dataset", "show", "mnist@v1", "--json", env=env).ok()
    assert (shown.json()["digest"], shown.json()["author"]) == (manifest, "alice")
    # The whole ledger's log stays an audit.
    refused = vault.server.run("log", env=env)
    assert refused.returncode == 77  # EX_NOPERM
    assert refused.error_line().startswith(
        "vault: PERMISSION_DENIED: alice (writer) may not call Ledger.Log but for dataset pins"
    )
    with pytest.raises(PermissionDenied, match=r"may not call Ledger\.Log"):
        list(writer.log(kind="run"))
