"""A seccomp filter for the python sandbox: fewer kernel interfaces within reach of model-written code.

bwrap loads it (`--seccomp FD`) just before it runs the program. The namespaces already take away
what needs privilege; this removes interfaces an unprivileged process could still use and that have
been the usual way out of such sandboxes (eBPF, userfaultfd, io_uring, perf events, keyrings), plus
ptrace and mount-style calls it has no use for. Blocked calls fail with ENOSYS, as if the kernel lacked
them; a call made through another ABI (x32) fails the same way; another architecture is killed.

`socket` and `socketpair` are filtered on their first argument: only the families the network namespace
covers (AF_UNIX, AF_INET, AF_INET6; AF_NETLINK, which the C library asks about interfaces on) are open,
every other (AF_VSOCK, which reaches the hypervisor, AF_PACKET, AF_BLUETOOTH, ...) fails with EAFNOSUPPORT,
as if the kernel lacked it. x86_64 has no multiplexed socketcall/ipc; the 32-bit ABI, which has them, is
killed by the architecture check. The kernel takes the family as an int, so its low 32 bits are compared.
Only x86_64 has a table; elsewhere the sandbox runs without a filter (`seccomp_filter()` is None).
"""

from __future__ import annotations

import errno
import platform
import struct

_AUDIT_ARCH_X86_64 = 0xC000003E
_X32_SYSCALL_BIT = 0x40000000

# name -> x86_64 number (arch/x86/entry/syscalls/syscall_64.tbl)
_BLOCKED_X86_64 = {
    "ptrace": 101, "syslog": 103, "personality": 135, "pivot_root": 155, "chroot": 161, "acct": 163,
    "mount": 165, "umount2": 166, "quotactl": 179, "lookup_dcookie": 212, "add_key": 248,
    "request_key": 249, "keyctl": 250, "unshare": 272, "perf_event_open": 298, "fanotify_init": 300,
    "name_to_handle_at": 303, "open_by_handle_at": 304, "setns": 308, "process_vm_readv": 310,
    "process_vm_writev": 311, "kcmp": 312, "bpf": 321, "userfaultfd": 323, "io_uring_setup": 425,
    "io_uring_enter": 426, "io_uring_register": 427, "fsopen": 430, "fsmount": 432, "open_tree": 428,
    "move_mount": 429, "mount_setattr": 442,
}

_SOCKET_CALLS_X86_64 = {"socket": 41, "socketpair": 53}
# AF_UNIX, AF_INET, AF_INET6, AF_NETLINK
ALLOWED_SOCKET_FAMILIES = (1, 2, 10, 16)

_LD_W_ABS, _JEQ_K, _JGE_K, _RET_K = 0x20, 0x15, 0x35, 0x06
_RET_ALLOW, _RET_KILL_PROCESS = 0x7FFF0000, 0x80000000
_RET_ERRNO = 0x00050000
_RET_ENOSYS = _RET_ERRNO | errno.ENOSYS
_RET_EAFNOSUPPORT = _RET_ERRNO | errno.EAFNOSUPPORT
_NR, _ARCH, _ARG0 = 0, 4, 16  # offsets in struct seccomp_data (args[0]'s low word on little-endian)


def seccomp_filter() -> bytes | None:
    """The filter as the array of `struct sock_filter` bwrap reads, or None on an architecture without a table."""
    if platform.machine() != "x86_64":
        return None
    numbers = sorted(_BLOCKED_X86_64.values())
    prog = [
        (_LD_W_ABS, 0, 0, _ARCH),
        (_JEQ_K, 1, 0, _AUDIT_ARCH_X86_64),
        (_RET_K, 0, 0, _RET_KILL_PROCESS),
        (_LD_W_ABS, 0, 0, _NR),
    ]
    # then: the socket calls jump to the family check; the blocked calls to ENOSYS; the rest is allowed
    sockets = [(_JEQ_K, nr) for nr in _SOCKET_CALLS_X86_64.values()]
    checks = [(_JGE_K, _X32_SYSCALL_BIT)] + [(_JEQ_K, nr) for nr in numbers]
    for i, (op, k) in enumerate(sockets):
        to_family_check = len(sockets) - i + len(checks) + 1  # past the checks, the allow and the ENOSYS
        prog.append((op, to_family_check, 0, k))
    for i, (op, k) in enumerate(checks):
        to_enosys = len(checks) - i  # skip the rest of the checks and the allow
        prog.append((op, to_enosys, 0, k))
    prog += [(_RET_K, 0, 0, _RET_ALLOW), (_RET_K, 0, 0, _RET_ENOSYS)]
    # the family check: an allowed family jumps to the last allow, any other gets EAFNOSUPPORT
    prog.append((_LD_W_ABS, 0, 0, _ARG0))
    for i, family in enumerate(ALLOWED_SOCKET_FAMILIES):
        prog.append((_JEQ_K, len(ALLOWED_SOCKET_FAMILIES) - i, 0, family))
    prog += [(_RET_K, 0, 0, _RET_EAFNOSUPPORT), (_RET_K, 0, 0, _RET_ALLOW)]
    return b"".join(struct.pack("=HBBI", *ins) for ins in prog)
