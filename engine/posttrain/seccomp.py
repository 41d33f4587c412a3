"""The seccomp filter the bubblewrap sandbox loads (`bwrap --seccomp FD`): a compiled BPF
program that refuses the system calls code uses to leave or widen its namespaces, made with
libseccomp (Debian's `libseccomp2`, which apt itself depends on) through ctypes, as
Flatpak and systemd make theirs.

Everything not listed is allowed: the namespaces, the read-only view and the missing
capabilities do the containing, and the filter closes the doors a kernel leaves open to an
unprivileged process that holds no capability at all (new user namespaces, whose root has
every capability inside) or that are attack surface with no use in a tool call. A refused
call fails with EPERM (clone3 with ENOSYS, so the C library falls back to clone, whose flags
the filter can read; Docker's default profile does the same). Calls of another ABI (i386 via
`int 0x80`, x32) are not the filter's architecture: libseccomp kills the process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os

from engine.posttrain.bubblewrap import SandboxUnavailable

# Names libseccomp resolves for this architecture; one that does not exist here is skipped.
DENIED = (
    # namespaces, mounts and roots: the view would not hold
    "unshare", "setns", "mount", "umount", "umount2", "pivot_root", "chroot", "mount_setattr",
    "fsopen", "fsconfig", "fsmount", "fspick", "move_mount", "open_tree",
    # other processes and the kernel's keyrings, BPF, perf, modules, reboot, clocks
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd",
    # io_uring: its operations bypass seccomp's per-call view; attack surface (Docker refuses it too)
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "reboot",
    "swapon", "swapoff", "syslog", "acct", "quotactl", "quotactl_fd", "lookup_dcookie",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "iopl", "ioperm",
    # file handles bypass path permissions (the shocker escape)
    "open_by_handle_at", "name_to_handle_at",
)  # fmt: skip
# clone's flags that make namespaces (CLONE_NEWNS ... CLONE_NEWNET), refused one by one.
CLONE_NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
TIOCSTI = 0x5412  # push characters into a terminal's input (bwrap's --new-session also stops it)

SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_CMP_EQ, SCMP_CMP_MASKED_EQ = 4, 7


def SCMP_ACT_ERRNO(code: int) -> int:  # noqa: N802 - libseccomp's macro
    return 0x00050000 | (code & 0xFFFF)


class ArgCmp(ctypes.Structure):
    """struct scmp_arg_cmp: (argument index, comparison, datum_a, datum_b)."""

    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("a", ctypes.c_uint64), ("b", ctypes.c_uint64)]


def _library() -> ctypes.CDLL:
    name = ctypes.util.find_library("seccomp")
    if name is None:
        raise SandboxUnavailable(
            "the python tool's sandbox builds its seccomp filter with libseccomp, which is not installed: "
            "install the `libseccomp2` package (Debian/Ubuntu)"
        )
    lib = ctypes.CDLL(name, use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint, ctypes.POINTER(ArgCmp)
    ]  # fmt: skip
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    return lib


@functools.cache
def seccomp_program() -> bytes:
    """The filter as the BPF bytes `bwrap --seccomp` reads (built once per process)."""
    lib = _library()
    ctx = lib.seccomp_init(SCMP_ACT_ALLOW)
    assert ctx, "seccomp_init failed"
    try:

        def refuse(name: str, code: int, *conditions: ArgCmp) -> None:
            number = lib.seccomp_syscall_resolve_name(name.encode())
            if number < 0:  # not a system call on this architecture
                return
            array = (ArgCmp * len(conditions))(*conditions) if conditions else None
            rc = lib.seccomp_rule_add_array(ctx, SCMP_ACT_ERRNO(code), number, len(conditions), array)
            assert rc == 0, f"seccomp_rule_add {name}: {os.strerror(-rc)}"

        for name in DENIED:
            refuse(name, errno.EPERM)
        for flag in CLONE_NAMESPACE_FLAGS:  # clone(flags, ...): flags is argument 0 on x86-64 and arm64
            refuse("clone", errno.EPERM, ArgCmp(0, SCMP_CMP_MASKED_EQ, flag, flag))
        refuse("clone3", errno.ENOSYS)  # its flags are behind a pointer the filter cannot read
        refuse("ioctl", errno.EPERM, ArgCmp(1, SCMP_CMP_EQ, TIOCSTI, 0))
        fd = os.memfd_create("trainflow-seccomp")
        try:
            rc = lib.seccomp_export_bpf(ctx, fd)
            assert rc == 0, f"seccomp_export_bpf: {os.strerror(-rc)}"
            os.lseek(fd, 0, os.SEEK_SET)
            chunks = []
            while chunk := os.read(fd, 65536):
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)
    finally:
        lib.seccomp_release(ctx)
