"""A Pod's process as a machine of its own: run as a script between the
kubelet and the container's command, it enters the Pod's network namespace,
makes a UTS and a mount namespace of its own, and execs the command there.

    python sandbox.py '<Sandbox as JSON>' -- ARGV...

In the mount namespace (private propagation: nothing reaches the host):
- /tmp is a fresh tmpfs. The host's /tmp is hidden, save the paths named in
  `host_paths` that lie under it (the Pod's own directory, its hostPath
  volumes), which are bound back at the same place;
- /dev/shm is a fresh tmpfs of `shm_bytes` (see `kubetest.podspec`);
- /etc/hosts is `hosts_file` (which the kubelet keeps current).
The rest of the host's filesystem is seen as it is (there is no image). The
hostname is the Pod's. The process keeps its pid, so the parent-death signal
armed before and the kubelet's signals to its process group still reach it.

Only the standard library: it runs before anything of the Pod's.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWNET = 0x40000000
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
PRIVATE_DIRS = ("/tmp",)  # a fresh tmpfs each: what lies under them is hidden
EXIT_SANDBOX_FAILED = 128  # what a container runtime reports for a StartError


@dataclass(frozen=True)
class Sandbox:
    netns: str  # path of the Pod's network namespace
    hostname: str
    hosts_file: str
    cwd: str
    shm_bytes: int | None  # None: a tmpfs's default size (half the memory)
    host_paths: tuple[str, ...] = ()


def command(sandbox: Sandbox, argv: list[str]) -> list[str]:
    """The command line that runs `argv` in `sandbox`."""
    spec = json.dumps(asdict(sandbox), separators=(",", ":"))
    return [sys.executable, "-I", "-S", str(Path(__file__).resolve()), spec, "--", *argv]


def hidden(path: str) -> bool:
    """Whether the sandbox hides `path` of the host."""
    return any(path == d or path.startswith(d + "/") for d in PRIVATE_DIRS)


def binds_back(paths: tuple[str, ...]) -> list[str]:
    """The hidden paths to bind back, outermost first, none inside another
    (binding a directory brings back all that lies under it)."""
    chosen: list[str] = []
    for path in sorted({os.path.normpath(p) for p in paths if hidden(os.path.normpath(p))}):
        if not any(path == c or path.startswith(c + "/") for c in chosen):
            chosen.append(path)
    return chosen


# ------------------------------------------------------------- the script


class _Libc:
    def __init__(self) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)

    def _check(self, result: int, what: str) -> None:
        if result != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"{what}: {os.strerror(errno)}")

    def setns(self, path: str, kind: int) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            self._check(self._libc.setns(fd, kind), f"setns {path}")
        finally:
            os.close(fd)

    def unshare(self, flags: int) -> None:
        self._check(self._libc.unshare(flags), "unshare")

    def mount(
        self, source: str | None, target: str, fstype: str | None, flags: int, data: str | None
    ) -> None:
        def encode(text: str | None) -> bytes | None:
            return text.encode() if text is not None else None

        result: int = self._libc.mount(
            encode(source), target.encode(), encode(fstype), ctypes.c_ulong(flags), encode(data)
        )
        self._check(result, f"mount {target}")

    def sethostname(self, name: str) -> None:
        raw = name.encode()
        self._check(self._libc.sethostname(raw, len(raw)), "sethostname")


def enter(sandbox: Sandbox) -> None:
    """Make this process the Pod's machine (see the module docstring)."""
    libc = _Libc()
    libc.setns(sandbox.netns, CLONE_NEWNET)
    libc.unshare(CLONE_NEWNS | CLONE_NEWUTS)
    libc.mount(None, "/", None, MS_REC | MS_PRIVATE, None)
    libc.sethostname(sandbox.hostname[:64])
    # Opened before /tmp is covered: a bind from an open file still reaches
    # what the tmpfs hides (the mounts are this namespace's own by now).
    keep = [(path, os.open(path, os.O_PATH)) for path in binds_back(sandbox.host_paths)]
    hosts = os.open(sandbox.hosts_file, os.O_PATH)
    for private in PRIVATE_DIRS:
        libc.mount("tmpfs", private, "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
    size = "" if sandbox.shm_bytes is None else f",size={sandbox.shm_bytes}"
    libc.mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777{size}")
    for path, fd in keep:
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            os.makedirs(path, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            Path(path).touch()
        libc.mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC, None)
        os.close(fd)
    libc.mount(f"/proc/self/fd/{hosts}", "/etc/hosts", None, MS_BIND, None)
    os.close(hosts)
    os.makedirs(sandbox.cwd, exist_ok=True)  # in the fresh /tmp, if it lies there
    os.chdir(sandbox.cwd)


def main(args: list[str]) -> None:
    if len(args) < 3 or args[1] != "--":
        raise SystemExit("usage: sandbox.py SANDBOX_JSON -- ARGV...")
    spec = json.loads(args[0])
    sandbox = Sandbox(**{**spec, "host_paths": tuple(spec.get("host_paths", ()))})
    argv = args[2:]
    try:
        enter(sandbox)
    except OSError as exc:
        print(f"kubetest: cannot make the Pod's sandbox: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_SANDBOX_FAILED) from None
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        print(f"kubetest: cannot start {argv}: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_SANDBOX_FAILED) from None


if __name__ == "__main__":
    main(sys.argv[1:])
