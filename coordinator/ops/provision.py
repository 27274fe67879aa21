"""Provision a fleet's broker: per-device credentials, mosquitto password and ACL files, config."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import pwd
import secrets
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from coordinator.ops.broker_config import BrokerLimits, acl_text, mosquitto_conf
from coordinator.ops.certificates import write_test_certificates
from coordinator.ops.site_brokers import Site, bridge_lines, core_acl_lines, site_acl
from protocols import topics
from protocols.access import COORDINATOR_USER, DASHBOARD_USER, OPERATOR_USER, VIEWER_USER
from protocols.errors import PflError

logger = logging.getLogger(__name__)

PBKDF2_ITERATIONS = 101
"""What mosquitto_passwd 2.0 writes; mosquitto reads the count from each line."""
_SALT_BYTES = 12
_SECRET_MODE = 0o600


class ProvisionError(PflError):
    """The fleet cannot be provisioned (bad names, an existing deployment, a failed hash)."""


@dataclass(frozen=True)
class Credential:
    """One broker account."""

    username: str
    password: str


@dataclass(frozen=True)
class ProvisionResult:
    """What `provision` wrote, for the CLI to report and tests to use."""

    directory: Path
    fleet: str
    broker_url: str
    coordinator: Credential
    operator: Credential
    """`pfl-coord export`'s account (commands, reports)."""
    viewer: Credential
    """`pfl-coord status`'s account (read only)."""
    dashboard: Credential
    """`pfl-coord dashboard`'s account (read only)."""
    devices: dict[str, Credential]
    files: dict[str, Path] = field(default_factory=dict)
    chown_command: str | None = None
    """What still gives the broker's user its files (None: done here, as root)."""
    sites: dict[str, SiteAccounts] = field(default_factory=dict)
    """Each site of an aggregator tier: its broker's URL, aggregator and bridge accounts."""


@dataclass(frozen=True)
class SiteAccounts:
    """What `provision` wrote for one site (`coordinator.ops.site_brokers`)."""

    site: Site
    broker_url: str
    """Where its devices and aggregator connect (the core's URL for a site on the core)."""
    aggregator: Credential
    bridge: Credential | None
    """The bridge's account on the core (None: the site is on the core broker)."""
    files: dict[str, Path] = field(default_factory=dict)


BROKER_FILES = ("passwords", "acl", "mosquitto.conf", "ca.crt", "server.crt", "server.key")
"""What mosquitto reads after dropping to its own user; passwords and the key are 0600."""


def hand_to_broker_user(files: Mapping[str, Path], user: str = "mosquitto") -> str | None:
    """Make `user` own the broker's files, or say the command that will.

    mosquitto started as root drops to its `mosquitto` user and then refuses to read 0600 files
    it does not own. As root on a host that has that user, the files are chowned here;
    otherwise (not root, or the broker runs on another host) the exact command is returned.
    """
    paths = [files[name] for name in BROKER_FILES if name in files]
    command = f"chown {user}: " + " ".join(shlex.quote(str(path)) for path in paths)
    try:
        account = pwd.getpwnam(user)
    except KeyError:  # no broker on this host: run it where the files go
        return command
    if os.geteuid() != 0:
        return "sudo " + command
    for path in paths:
        os.chown(path, account.pw_uid, account.pw_gid)
    return None


def generate_password(nbytes: int = 24) -> str:
    """A random URL-safe password (192 bits by default) from the OS's CSPRNG."""
    return secrets.token_urlsafe(nbytes)


def hash_password(
    password: str, *, salt: bytes | None = None, iterations: int = PBKDF2_ITERATIONS
) -> str:
    """A mosquitto 2 password-file hash: `$7$<iterations>$<salt b64>$<PBKDF2-SHA512 b64>`.

    This is the format `mosquitto_passwd` 2.0 writes (12-byte salt, 64-byte SHA-512 PBKDF2
    digest, standard base64 with padding).
    """
    salt = secrets.token_bytes(_SALT_BYTES) if salt is None else salt
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations)
    encode = base64.b64encode
    return f"$7${iterations}${encode(salt).decode()}${encode(digest).decode()}"


def verify_password(password: str, line_hash: str) -> bool:
    """Whether `password` matches a `$7$` hash, as mosquitto checks it."""
    parts = line_hash.split("$")
    if len(parts) != 5 or parts[1] != "7":
        return False
    salt = base64.b64decode(parts[3])
    expected = hash_password(password, salt=salt, iterations=int(parts[2]))
    return secrets.compare_digest(expected, line_hash)


def write_password_file(
    path: Path, credentials: Sequence[Credential], *, use_mosquitto_passwd: bool = True
) -> str:
    """Write a mosquitto password file; return which tool hashed ("mosquitto_passwd" or "python").

    `mosquitto_passwd -b` is used when it is on PATH (it hashes exactly as the installed broker
    expects); otherwise, or when it fails, the hashes are computed here in the same format.
    """
    tool = shutil.which("mosquitto_passwd") if use_mosquitto_passwd else None
    if tool is not None:
        try:
            _write_private(path, "")
            for credential in credentials:
                subprocess.run(
                    [tool, "-b", str(path), credential.username, credential.password],
                    check=True,
                    capture_output=True,
                    timeout=30,
                )
            return "mosquitto_passwd"
        except (OSError, subprocess.SubprocessError) as error:
            logger.warning("mosquitto_passwd failed (%s); hashing in Python instead", error)
    lines = [f"{c.username}:{hash_password(c.password)}\n" for c in credentials]
    _write_private(path, "".join(lines))
    return "python"


def device_env(
    fleet: str, broker_url: str, credential: Credential, ca_file: str, *, is_device: bool = True
) -> str:
    """The `PFL_*` variables an agent (or the coordinator, or an operator) needs.

    E.g. for systemd's EnvironmentFile, or `set -a; . operator.env` before `pfl-coord status`.
    """
    device_line = f"PFL_DEVICE_ID={credential.username}\n" if is_device else ""
    return (
        f"PFL_BROKER={broker_url}\n"
        f"{device_line}"
        f"PFL_FLEET={fleet}\n"
        f"PFL_USERNAME={credential.username}\n"
        f"PFL_PASSWORD={credential.password}\n"
        f"PFL_CA_FILE={ca_file}\n"
    )


def provision(
    devices: Sequence[str],
    out: Path,
    *,
    fleet: str = "default",
    host: str = "localhost",
    tls_port: int = 8883,
    plain_port: int | None = None,
    broker_dir: Path | None = None,
    force: bool = False,
    use_mosquitto_passwd: bool = True,
    limits: BrokerLimits | None = None,
    sites: Sequence[Site] = (),
) -> ProvisionResult:
    """Write everything a TLS + ACL mosquitto and its fleet need into `out`.

    Files: `passwords`, `acl`, `mosquitto.conf`, `tls/` (a throwaway CA, server and client
    certificates: for tests only), `credentials.json` (every account), `coordinator.env`,
    one env file per operator tool (`operator.env` for export, `viewer.env` for status,
    `dashboard.env` for the dashboard: each its own account, so they run side by side) and
    `devices/<id>.env`. Secrets are written with mode 0600.

    Args:
        devices: Device ids; each becomes a broker user of the same name.
        out: The output directory (created).
        fleet: The fleet name in the topic prefix.
        host: The broker's host name or IP address, in the URLs and the server certificate.
        tls_port: The TLS listener's port.
        plain_port: Also a plain listener on 127.0.0.1:plain_port (None: none).
        broker_dir: Where `out`'s files will live on the broker host, for the paths in
            mosquitto.conf (default: `out`, absolute).
        force: Replace an earlier deployment in `out` (new passwords for everyone).
        use_mosquitto_passwd: Hash with `mosquitto_passwd` when installed.
        limits: Packet, queue and upload limits for the config and ACL (`BrokerLimits()`).
        sites: An aggregator tier's sites: a site with ports gets its own broker in
            `sites/<name>/` (passwords, ACL, mosquitto.conf bridged to this one, its
            aggregator's `aggregator.toml`), and its devices' env files point at it; a site
            without ports has its aggregator's account on this broker.

    Raises:
        ProvisionError: invalid or duplicate names, or `out` already holds a deployment.
    """
    listed = [*devices, *(d for site in sites for d in site.devices if d not in devices)]
    ids = [_checked(device_id, fleet) for device_id in listed]
    _check_sites(sites)
    if not ids:
        msg = "give at least one device id"
        raise ProvisionError(msg)
    if len(set(ids)) != len(ids):
        msg = f"device ids must be unique: {ids}"
        raise ProvisionError(msg)
    out = out.resolve()
    if (out / "credentials.json").exists() and not force:
        msg = f"{out} already holds a deployment; pass --force to replace every credential"
        raise ProvisionError(msg)
    (out / "devices").mkdir(parents=True, exist_ok=True)
    broker_dir = out if broker_dir is None else broker_dir
    coordinator = Credential(COORDINATOR_USER, generate_password())
    operator, viewer, dashboard = (
        Credential(user, generate_password())
        for user in (OPERATOR_USER, VIEWER_USER, DASHBOARD_USER)
    )
    tools = (coordinator, operator, viewer, dashboard)
    accounts = {device_id: Credential(device_id, generate_password()) for device_id in ids}
    services = {
        user: Credential(user, generate_password())
        for site in sites
        for user in (site.aggregator_user, site.bridge_user)
    }
    files = write_test_certificates(
        out / "tls", host, [*(tool.username for tool in tools), *ids, *services]
    )
    away = {d for site in sites if site.bridged for d in site.devices}
    core_ids = [d for d in ids if d not in away]
    on_core = [services[s.bridge_user if s.bridged else s.aggregator_user] for s in sites]
    hasher = write_password_file(
        out / "passwords",
        [*tools, *(accounts[d] for d in core_ids), *on_core],
        use_mosquitto_passwd=use_mosquitto_passwd,
    )
    logger.info("password hashes by %s", hasher)
    acl = acl_text(fleet, core_ids, limits) + "\n".join(core_acl_lines(fleet, sites))
    (out / "acl").write_text(acl.rstrip("\n") + "\n")
    (out / "mosquitto.conf").write_text(
        mosquitto_conf(broker_dir, tls_port=tls_port, plain_port=plain_port, limits=limits)
    )
    url = f"mqtts://{host}:{tls_port}"
    ca_file = str(files["ca.crt"])
    placed = {
        site.name: _write_site(
            site,
            out,
            broker_dir,
            fleet,
            (host, tls_port),
            services,
            accounts,
            limits,
            use_mosquitto_passwd=use_mosquitto_passwd,
        )
        for site in sites
    }
    site_of = {
        d: placed[site.name].broker_url for site in sites if site.bridged for d in site.devices
    }
    for account in tools:
        env = device_env(fleet, url, account, ca_file, is_device=False)
        _write_private(out / f"{account.username.removeprefix('pfl-')}.env", env)
    for credential in accounts.values():
        env = device_env(fleet, site_of.get(credential.username, url), credential, ca_file)
        _write_private(out / "devices" / f"{credential.username}.env", env)
    _write_private(
        out / "credentials.json",
        json.dumps(
            _credentials_json(fleet, url, ca_file, tools, accounts, files, placed),
            indent=2,
        ),
    )
    files.update(
        {name: out / name for name in ("passwords", "acl", "mosquitto.conf", "credentials.json")}
    )
    pending = [hand_to_broker_user(files)]
    pending += [hand_to_broker_user(placed_site.files) for placed_site in placed.values()]
    chown = " && ".join(command for command in pending if command) or None
    return ProvisionResult(
        out, fleet, url, coordinator, operator, viewer, dashboard, accounts, files, chown, placed
    )


def _check_sites(sites: Sequence[Site]) -> None:
    names = [site.name for site in sites]
    for name in names:
        _checked(name, "fleet")  # a topic segment: tier/<site>/partial
    listed = [d for site in sites for d in site.devices]
    if len(set(names)) != len(names) or len(set(listed)) != len(listed):
        msg = "site names must be unique, and each device in one site only"
        raise ProvisionError(msg)


def _write_site(
    site: Site,
    out: Path,
    broker_dir: Path,
    fleet: str,
    core: tuple[str, int],
    services: Mapping[str, Credential],
    accounts: Mapping[str, Credential],
    limits: BrokerLimits | None,
    *,
    use_mosquitto_passwd: bool,
) -> SiteAccounts:
    """A site's broker files (if it has its own broker) and its aggregator's settings file."""
    host, core_port = core
    directory = out / "sites" / site.name
    directory.mkdir(parents=True, exist_ok=True)
    aggregator = services[site.aggregator_user]
    bridge = services[site.bridge_user] if site.bridged else None
    url = f"mqtts://{host}:{core_port}"
    files: dict[str, Path] = {}
    if site.tls_port is not None and bridge is not None:
        url = f"mqtts://{host}:{site.tls_port}"
        write_password_file(
            directory / "passwords",
            [aggregator, *(accounts[d] for d in site.devices)],
            use_mosquitto_passwd=use_mosquitto_passwd,
        )
        chunks = (limits or BrokerLimits()).max_chunks
        (directory / "acl").write_text(site_acl(fleet, site, chunks))
        site_dir = broker_dir / "sites" / site.name
        conf = mosquitto_conf(
            site_dir,
            tls_port=site.tls_port,
            plain_port=site.plain_port,
            limits=limits,
            tls_directory=broker_dir / "tls",
        )
        ca = broker_dir / "tls" / "ca.crt"
        lines = bridge_lines(fleet, site, host, core_port, bridge.password, ca)
        _write_private(directory / "mosquitto.conf", conf + "\n".join(lines) + "\n")
        files = {name: directory / name for name in ("passwords", "acl", "mosquitto.conf")}
    settings = {
        "broker": url,
        "name": site.name,
        "fleet": fleet,
        "devices": list(site.devices),
        "username": aggregator.username,
        "password": aggregator.password,
        "ca_file": str(out / "tls" / "ca.crt"),
    }
    _write_private(directory / "aggregator.toml", _toml(settings))
    files["aggregator.toml"] = directory / "aggregator.toml"
    return SiteAccounts(site, url, aggregator, bridge, files)


def _toml(values: Mapping[str, object]) -> str:
    """Flat TOML of strings and lists of strings (JSON strings are TOML basic strings)."""
    return "".join(f"{key} = {json.dumps(value)}\n" for key, value in values.items())


def _credentials_json(
    fleet: str,
    url: str,
    ca_file: str,
    tools: Sequence[Credential],
    accounts: Mapping[str, Credential],
    files: Mapping[str, Path],
    sites: Mapping[str, SiteAccounts],
) -> dict[str, object]:
    def entry(credential: Credential) -> dict[str, str]:
        return {
            "username": credential.username,
            "password": credential.password,
            "cert_file": str(files[f"{credential.username}.crt"]),
            "key_file": str(files[f"{credential.username}.key"]),
        }

    return {
        "fleet": fleet,
        "broker_url": url,
        "ca_file": ca_file,
        **{tool.username.removeprefix("pfl-"): entry(tool) for tool in tools},
        "devices": {device_id: entry(c) for device_id, c in accounts.items()},
        "sites": {
            name: {
                "broker_url": placed.broker_url,
                "devices": list(placed.site.devices),
                "aggregator": entry(placed.aggregator),
                "bridge": None if placed.bridge is None else entry(placed.bridge),
            }
            for name, placed in sites.items()
        },
    }


def _checked(device_id: str, fleet: str) -> str:
    """A device id usable both as a topic segment and as a mosquitto user name."""
    try:
        topics.device_subtree(fleet, device_id)
    except PflError as error:
        raise ProvisionError(str(error)) from None
    return device_id


def _write_private(path: Path, text: str) -> None:
    """Write `text` to `path` with mode 0600, atomically."""
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(descriptor, "w") as handle:
            handle.write(text)
        os.chmod(temporary, _SECRET_MODE)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
