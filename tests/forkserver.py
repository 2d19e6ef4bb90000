"""Python child processes that start without importing JAX again: a fork server.

A test that runs ``python script.py ...`` (or ``python -c code ...``, ``python -m module ...``) whose child
imports JAX pays about a second of CPU for the import alone, hundreds of times in the suite. ``Popen``
and ``run`` here take the same arguments as ``subprocess.Popen`` and ``subprocess.run``, but the child is
forked from a server process (one per test process, started on first use) that has imported numpy, jax
and jax.numpy and never started a JAX backend: forking before any backend exists is safe, and the
child then starts its own backend with its own environment (XLA_FLAGS, JAX_PLATFORMS).

The child is a real, separate process: ``pid`` is its own; it gets the standard streams, working
folder, environment, argv, session (``start_new_session``) and umask the test asked for; signals sent
to it (or to its process group) are real signals; its exit status, or the signal that ended it,
comes back as ``returncode`` (the server waits for it and reports). It dies when the server dies, and
the server when the test process does (prctl PR_SET_PDEATHSIG), as ``die_with_parent`` asks.

What a fork cannot give runs as a plain process instead, same ``pid``: an environment whose PYTHON*
variables (other than PYTHONPATH) or JAX_* variables differ in a way the child cannot apply, makes the
forked child ``exec`` a fresh interpreter; interpreter options (``-u``, ``-X ...``), another program,
``shell``, ``pass_fds``, ``preexec_fn`` other than ``die_with_parent``, user or group changes go to
``subprocess.Popen`` as they are. ``FLAX_CKPT_TEST_FORKSERVER=0`` sends everything there.

Not for a child whose test examines what a fresh interpreter imports (``sys.modules``, ``-X
importtime``): a forked child has jax imported before its first line runs.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
from typing import Any

# Not flax or optax: they import absl.logging, which makes the "absl" logger that flax_ckpt's callbacks
# look at; a child that does not import them must not find it.
_PRELOAD = ("numpy", "jax", "jax.numpy")
_HEADER = struct.Struct("!I")
CPU = [0.0]  # CPU seconds of the forked children that have exited (tests/timing.py adds them in)


# ------------------------------------------------------------------------------------ the test side


class _Server:
    """The server process of this test process, started on first use."""

    lock = threading.Lock()
    proc: subprocess.Popen | None = None
    path = ""

    @classmethod
    def address(cls) -> str:
        with cls.lock:
            if cls.proc is None or cls.proc.poll() is not None:
                import atexit
                import shutil
                import tempfile

                from basics import die_with_parent

                folder = tempfile.mkdtemp(prefix="flax_ckpt_forkserver_")
                atexit.register(shutil.rmtree, folder, True)  # the socket's folder
                cls.path = os.path.join(folder, "socket")
                # JAX's options as at their defaults (but CPU): a child applies its own (_take_env).
                env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("JAX_")}
                env["JAX_PLATFORMS"] = "cpu"
                cls.proc = subprocess.Popen(
                    [sys.executable, os.path.abspath(__file__), cls.path],
                    env=env,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    preexec_fn=die_with_parent,
                )
                assert cls.proc.stdout is not None
                line = cls.proc.stdout.readline()
                if line.strip() != b"ready":
                    raise RuntimeError(f"the fork server did not start: {line!r}")
            return cls.path


def _enabled() -> bool:
    return os.environ.get("FLAX_CKPT_TEST_FORKSERVER", "1") != "0"


def _forkable(args: Any, kw: dict) -> bool:
    if not _enabled() or isinstance(args, (str, bytes)) or kw.get("shell") or kw.get("executable"):
        return False
    args = [os.fspath(a) for a in args]
    if len(args) < 2 or os.path.realpath(args[0]) != os.path.realpath(sys.executable):
        return False
    if args[1] in ("-c", "-m"):
        if len(args) < 3:
            return False
    elif args[1].startswith("-"):
        return False
    from basics import die_with_parent

    if kw.get("preexec_fn") not in (None, die_with_parent) or kw.get("pass_fds"):
        return False
    return all(kw.get(k) is None for k in ("user", "group", "extra_groups", "process_group"))


class _Forked(subprocess.Popen):
    """A ``subprocess.Popen`` whose child the fork server made (see the module's docstring)."""

    _conn: socket.socket

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                       restore_signals, gid, gids, uid, umask, start_new_session, *rest):  # fmt: skip
        args = [os.fspath(a) for a in args]
        request = {
            "argv": args[1:],
            "cwd": os.fspath(cwd) if cwd is not None else os.getcwd(),
            "env": {os.fsdecode(k): os.fsdecode(v) for k, v in (os.environ if env is None else env).items()},
            "session": bool(start_new_session),
            "umask": umask,
        }
        fds = [
            p2cread if p2cread != -1 else 0,
            c2pwrite if c2pwrite != -1 else 1,
            errwrite if errwrite != -1 else 2,
        ]
        body = json.dumps(request).encode()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(_Server.address())
            socket.send_fds(conn, [_HEADER.pack(len(body))], fds)
            conn.sendall(body)
            reply = _readline(conn)
            if not reply.startswith(b"pid "):
                raise OSError(f"the fork server did not start {args}: {reply!r}")
            self.pid = int(reply.split()[1])
        except BaseException:
            conn.close()
            raise
        finally:
            devnull = getattr(self, "_devnull", None)
            for fd, ours in ((p2cread, p2cwrite), (c2pwrite, c2pread), (errwrite, errread)):
                if fd != -1 and ours != -1 and fd != devnull:
                    os.close(fd)
            if devnull is not None:
                os.close(devnull)
                del self._devnull
        self._conn = conn
        self._child_created = True

    def _status(self, block: bool) -> int | None:
        """The child's wait status from the server; None while it runs (``block``: waits for it)."""
        try:
            line = _readline(self._conn, block)
        except BlockingIOError:
            return None
        self._conn.close()
        if not line.startswith(b"exit "):
            return 9  # the server died: so did the child (SIGKILL, by PR_SET_PDEATHSIG)
        _, status, cpu = line.split()
        CPU[0] += float(cpu)
        return int(status)

    def _try_wait(self, wait_flags):
        status = self._status(block=not wait_flags & os.WNOHANG)
        return (0, 0) if status is None else (self.pid, status)

    def _internal_poll(self, _deadstate=None, **_):
        if self.returncode is None and self._waitpid_lock.acquire(False):
            try:
                if self.returncode is None:
                    status = self._status(block=False)
                    if status is not None:
                        self._handle_exitstatus(status)
            except OSError:
                if _deadstate is not None:
                    self.returncode = _deadstate
            finally:
                self._waitpid_lock.release()
        return self.returncode


def _readline(conn: socket.socket, block: bool = True) -> bytes:
    """One line from the server ("pid N", "exit STATUS CPU"); BlockingIOError where none has come yet
    (``block`` False)."""
    conn.setblocking(block)
    try:
        data = conn.recv(1)
    finally:
        conn.setblocking(True)
    while data and not data.endswith(b"\n"):
        chunk = conn.recv(1)
        if not chunk:
            break
        data += chunk
    return data


def Popen(args: Any, **kw: Any) -> subprocess.Popen:
    """``subprocess.Popen(args, **kw)``, the child forked from the fork server where it can be."""
    return _Forked(args, **kw) if _forkable(args, kw) else subprocess.Popen(args, **kw)


def run(args: Any, *, input=None, capture_output=False, timeout=None, check=False, **kw: Any):
    """``subprocess.run(args, ...)``, the child forked from the fork server where it can be."""
    if not _forkable(args, kw):
        return subprocess.run(
            args, input=input, capture_output=capture_output, timeout=timeout, check=check, **kw
        )
    if input is not None:
        kw["stdin"] = subprocess.PIPE
    if capture_output:
        kw["stdout"] = kw["stderr"] = subprocess.PIPE
    with _Forked(args, **kw) as process:
        try:
            stdout, stderr = process.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            process.kill()
            exc.stdout, exc.stderr = process.communicate()
            raise
        except BaseException:
            process.kill()
            raise
    result = subprocess.CompletedProcess(process.args, process.poll(), stdout, stderr)
    if check:
        result.check_returncode()
    return result


# ---------------------------------------------------------------------------------- the server side


def _serve(path: str) -> None:
    import warnings

    warnings.filterwarnings("ignore", category=DeprecationWarning)  # os.fork beside numpy's threads
    for name in _PRELOAD:
        __import__(name)
    warnings.resetwarnings()
    base_env = dict(os.environ)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: dict[int, socket.socket] = {}
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    import select

    while True:
        ready, _, _ = select.select([listener, wake_r, sys.stdin], [], [])
        if sys.stdin in ready and not os.read(sys.stdin.fileno(), 1):
            listener.close()
            for remove in (os.unlink, os.rmdir):
                try:
                    remove(path if remove is os.unlink else os.path.dirname(path))
                except OSError:
                    pass
            return  # the test process has gone: PR_SET_PDEATHSIG ends the children
        if wake_r in ready:
            os.read(wake_r, 4096)
        while children:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(b"exit %d %.3f\n" % (status, usage.ru_utime + usage.ru_stime))
                except OSError:
                    pass
                conn.close()
        if listener in ready:
            conn, _ = listener.accept()
            header, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 3)
            (size,) = _HEADER.unpack(header)
            body = b""
            while len(body) < size:
                body += conn.recv(size - len(body))
            request = json.loads(body)
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for fd in (wake_r, wake_w, sys.stdin.fileno()):
                    os.close(fd)
                listener.close()
                conn.close()
                for other in children.values():
                    other.close()
                _child(request, fds, base_env)  # never returns
            for fd in fds:
                os.close(fd)
            children[pid] = conn
            conn.sendall(b"pid %d\n" % pid)


def _child(request: dict, fds: list[int], base_env: dict[str, str]) -> None:
    """In the forked child: become the process the test asked for, run it, and leave as an interpreter
    does (SystemExit up through the server's frames: non-daemon threads joined, atexit, finalization)."""
    try:
        if request["session"]:
            os.setsid()
        from basics import die_with_parent

        die_with_parent()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in set(fds) - {0, 1, 2}:
            os.close(fd)
        os.chdir(request["cwd"])
        if request["umask"] is not None and request["umask"] >= 0:
            os.umask(request["umask"])
        env, argv = request["env"], request["argv"]
        os.environ.clear()
        os.environ.update(env)
        if not _take_env(env, base_env):
            os.execve(sys.executable, [sys.executable, *argv], env)
        _streams()
        import numpy

        numpy.random.seed()  # as a fresh process: the global generator from the OS's entropy
        pythonpath = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        if argv[0] == "-c":
            first = ""
        elif argv[0] == "-m":
            first = os.getcwd()
        else:
            first = os.path.dirname(os.path.realpath(argv[0]))
        sys.path[:] = [first, *pythonpath, *BASE_PATH]
    except BaseException:
        import traceback

        traceback.print_exc()
        os._exit(1)
    _main(argv)
    raise SystemExit(0)


def _take_env(env: dict[str, str], base: dict[str, str]) -> bool:
    """Applies what the server read at import from its environment and the child's differs in (JAX_*
    options); False where a fresh interpreter is needed (PYTHON* options but PYTHONPATH)."""
    changed = {k for k in set(env) | set(base) if env.get(k) != base.get(k)}
    if any(k.startswith("PYTHON") and k != "PYTHONPATH" for k in changed):
        return False
    import jax

    holders = getattr(jax.config, "_value_holders", None)
    if holders is None:
        return not any(k.startswith("JAX_") for k in changed)
    for key in sorted(k for k in changed if k.startswith("JAX_")):
        name = key.lower()
        if name not in holders or key not in env:
            return False
        current, text = holders[name].value, env[key]
        try:
            if isinstance(current, bool):
                value: Any = text.lower() in ("y", "yes", "t", "true", "on", "1")
            elif isinstance(current, int):
                value = int(text)
            elif isinstance(current, float):
                value = float(text)
            else:
                value = text
            jax.config.update(name, value)
        except Exception:
            return False
    return True


def _streams() -> None:
    """New sys.stdin/stdout/stderr over fds 0-2, buffered as at an interpreter's start."""
    import io

    def text(fd: int, mode: str, **kw: Any) -> io.TextIOWrapper:
        return open(fd, mode, encoding="utf-8", closefd=False, **kw)  # noqa: SIM115

    sys.stdin = sys.__stdin__ = text(0, "r")
    sys.stdout = sys.__stdout__ = text(1, "w", buffering=1 if os.isatty(1) else -1)
    sys.stderr = sys.__stderr__ = text(2, "w", errors="backslashreplace", buffering=1)


def _main(argv: list[str]) -> None:
    """Runs the script, ``-c`` code or ``-m`` module in a new ``__main__`` module, as ``python`` does; an
    uncaught exception is printed and becomes exit status 1 (KeyboardInterrupt: death by SIGINT)."""
    import builtins
    import types

    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    try:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        elif argv[0] == "-m":
            import runpy

            sys.argv = ["-m", *argv[2:]]
            runpy._run_module_as_main(argv[1])  # type: ignore[attr-defined]  # what python -m runs
        else:
            from importlib.machinery import SourceFileLoader

            sys.argv = list(argv)
            main.__dict__.update(
                __file__=argv[0], __cached__=None, __loader__=SourceFileLoader("__main__", argv[0])
            )
            with open(argv[0], "rb") as f:
                source = f.read()
            exec(compile(source, argv[0], "exec"), main.__dict__)
    except SystemExit:
        raise
    except KeyboardInterrupt as exc:
        _print(exc)
        _die_by(signal.SIGINT)
    except BaseException as exc:
        _print(exc)
        raise SystemExit(1) from None


def _print(exc: BaseException) -> None:
    """The traceback an interpreter prints, without this module's and runpy's frames."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>"):
        tb = tb.tb_next
    sys.excepthook(type(exc), exc.with_traceback(tb), tb)


def _die_by(sig: int) -> None:
    """An interpreter's exit after an uncaught KeyboardInterrupt: threads joined, atexit run, streams
    flushed, then death by the signal."""
    import atexit

    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)


BASE_PATH = sys.path[1:]  # the interpreter's own path, less this script's folder (a child has its own)

if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "harness"))
    _serve(sys.argv[1])
