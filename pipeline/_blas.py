"""OpenBLAS for MLX's CPU matmuls on Linux, from the ``scipy-openblas32`` wheel.

The Linux ``mlx[cpu]`` wheel bundles netlib's reference BLAS and LAPACK (a float32 40x576x576 GEMM:
~8 ms on a 2-core x86_64 machine; through OpenBLAS ~0.2 ms). ``scipy-openblas32`` is the OpenBLAS
build NumPy and SciPy ship (the OpenBLAS-libs project: manylinux x86_64 and aarch64 wheels, the
Fortran runtime linked in, so it loads on a machine without ``libgfortran``). Its symbols carry a
``scipy_`` prefix, so it cannot stand in for ``cblas_sgemm`` by itself: ``load_openblas`` writes a
small ELF shared object (no code, only a dynamic symbol table) whose symbols ``cblas_sgemm``, ...
are absolute (``SHN_ABS``) at the addresses of ``scipy_cblas_sgemm``, ... in the loaded library, and
loads it with ``RTLD_GLOBAL`` before ``mlx.core``. The dynamic linker then binds ``libmlx.so``'s
calls straight to OpenBLAS (glibc >= 2.28 does not relocate ``SHN_ABS`` symbols; the mlx-cpu wheel
needs glibc >= 2.35). The binding is checked with ``dlsym`` before it counts as loaded.

On x86-64, ``cblas_sgemm`` is bound to a small forwarder instead (``gemv_forward``): single-row products
(a batch-1 decode step's) go to ``cblas_sgemv``, which OpenBLAS runs at about twice the bandwidth of its
sgemm on one row. ``PIPELINE_GEMV_FORWARD=0`` binds sgemm directly.

This must run before ``mlx.core`` is first imported (``import pipeline`` does it). Set
``PIPELINE_BLAS=reference`` to keep the bundled reference BLAS.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import platform
import struct
import sys

log = logging.getLogger("pipeline")

# The BLAS and LAPACK routines libmlx.so imports (mlx-cpu 0.32: `nm -D --undefined-only libmlx.so`),
# plus the GEMVs older MLX releases called; a name MLX does not import costs nothing.
ROUTINES = (
    "cblas_sgemm", "cblas_dgemm", "cblas_cgemm", "cblas_zgemm", "cblas_sgemv", "cblas_dgemv",
    "sgeev_", "dgeev_", "cgeev_", "sgesdd_", "dgesdd_", "cgesdd_", "ssyevd_", "dsyevd_", "cheevd_",
    "sgeqrf_", "dgeqrf_", "sorgqr_", "dorgqr_", "sgetrf_", "dgetrf_", "sgetri_", "dgetri_",
    "spotrf_", "dpotrf_", "strtri_", "dtrtri_",
)
_ELF_MACHINE = {"x86_64": 62, "amd64": 62, "aarch64": 183, "arm64": 183}  # EM_X86_64, EM_AARCH64 (elf.h)

# The ``cblas_sgemm`` MLX calls on x86-64: single-row products (M = 1, row-major, A not transposed, K > 0: a
# batch-1 decode step's x @ W.T) go to ``cblas_sgemv``; every other call jumps to ``cblas_sgemm`` unchanged.
# OpenBLAS's sgemm runs a single row at about half its sgemv's bandwidth (scipy-openblas32 0.3.34, SkylakeX
# kernels, 2 threads, a 153,600 x 576 float32 matrix: 11.5 against 21.1 GB/s on a 2-core x86_64 VM; its
# GEMM_GEMV_FORWARD build option does the same inside OpenBLAS, not on in this build). System V AMD64 ABI:
# both functions take their first six integer arguments in registers and the rest on the stack, floats
# (alpha, beta) in xmm0 and xmm1, which carry over; sgemv's four stack arguments are written over sgemm's
# incoming ones (the callee's to use) and the jump is a tail call. Assembled with GNU as 2.40 from:
#       cmp ecx, 1 ; jne G ; test r9d, r9d ; jz G         M == 1, K > 0
#       cmp edi, 101 ; jne G ; cmp esi, 111 ; jne G       CblasRowMajor, A CblasNoTrans
#       cmp edx, 112 ; je T ; cmp edx, 111 ; jne G
#       mov esi, 112 ; mov edx, r9d ; mov ecx, r8d ; jmp S     B (K x N): y = B^T x, sgemv Trans K x N
#   T:  mov esi, 111 ; mov edx, r8d ; mov ecx, r9d             B (N x K): y = B x, sgemv NoTrans N x K
#   S:  mov rax, [rsp+8] ; mov r10, [rsp+40]                   A (x), C (y)
#       mov r8, [rsp+24] ; mov r9d, [rsp+32]                   B and ldb as sgemv's matrix and lda
#       mov [rsp+8], rax ; mov qword ptr [rsp+16], 1           x, incx
#       mov [rsp+24], r10 ; mov qword ptr [rsp+32], 1          y, incy
#       movabs rax, SGEMV ; jmp rax
#   G:  movabs rax, SGEMM ; jmp rax
_GEMV_FORWARD_X86_64 = bytes.fromhex(
    "83f901756d4585c9746883ff65756383fe6f755e83fa70741283fa6f7554be700000004489ca4489c1eb0bbe6f0000004489c2"
    "4489c9488b4424084c8b5424284c8b442418448b4c2420488944240848c7442410010000004c8954241848c744242001000000"
    "48b81111111111111111ffe048b82222222222222222ffe0")
_SGEMV_IMM, _SGEMM_IMM = 104, 116  # offsets of the two movabs immediates
_CODE: list = []  # the forwarder's executable pages, kept for the life of the process
_FIX = "pip install --force-reinstall scipy-openblas32"


@dataclasses.dataclass(frozen=True)
class BlasState:
    """Which BLAS MLX's CPU matmuls use in this process.

    Attributes:
        active: OpenBLAS serves MLX's CPU BLAS calls.
        name: ``"OpenBLAS from scipy-openblas32 0.3.34.481.3"``, ``"Accelerate"`` (macOS) or
            ``"reference BLAS bundled with mlx"``.
        core: OpenBLAS's kernel set for this CPU (``"Haswell"``, ``"NeoverseN1"``...), or None.
        threads: OpenBLAS's thread count (``OPENBLAS_NUM_THREADS``, default: the CPU count), or None.
        path: the OpenBLAS library file, or None.
        reason: why OpenBLAS is not active (None when it is, or where it is not expected).
        expected: the fast path is promised here (Linux, not turned off by ``PIPELINE_BLAS=reference``).
        gemv_forward: MLX's single-row products run on OpenBLAS's sgemv (``gemv_forward``; x86-64).
    """

    active: bool
    name: str
    core: str | None = None
    threads: int | None = None
    path: str | None = None
    reason: str | None = None
    expected: bool = False
    gemv_forward: bool = False

    def line(self) -> str:
        """``"OpenBLAS from scipy-openblas32 0.3.34.481.3, Haswell kernels, 2 threads, single-row products on
        sgemv"``, or the name and why OpenBLAS is off."""
        if self.active:
            line = f"{self.name}, {self.core} kernels, {self.threads} thread{'s' * (self.threads != 1)}"
            return line + (", single-row products on sgemv" if self.gemv_forward else "")
        return self.name + (f" ({self.reason})" if self.reason else "")

    def short(self) -> str:
        """``line()`` when active; else the name, and where the fast path was promised, a pointer to the
        warning (for the run's summary line)."""
        return self.line() if self.active or not self.expected else f"{self.name}, slow: see the warning above"

    def to_dict(self) -> dict:
        """The run record's and benchmark document's ``blas`` entry."""
        return {"name": self.name, "active": self.active, "core": self.core, "threads": self.threads,
                "reason": self.reason, "gemv_forward": self.gemv_forward, "line": self.line()}


STATE = BlasState(active=False, name="not checked yet")
LOADED: str | None = None  # the OpenBLAS library path once it serves MLX's calls
_LIB = None  # keeps scipy-openblas32 loaded for the life of the process
_warned = False


def load_openblas() -> str | None:
    """Route MLX's CPU BLAS/LAPACK calls to OpenBLAS (see the module docstring); sets ``STATE``.

    Returns:
        the OpenBLAS library path, or None when it is not active (``STATE.reason`` says why). Never raises.
    """
    global STATE, LOADED, _LIB
    if LOADED:
        return LOADED
    if sys.platform == "darwin":
        STATE = BlasState(active=False, name="Accelerate")
        return None
    if sys.platform != "linux":
        STATE = BlasState(active=False, name="the BLAS bundled with mlx")
        return None
    reference = "reference BLAS bundled with mlx"
    if os.environ.get("PIPELINE_BLAS") == "reference":
        STATE = BlasState(active=False, name=reference, reason="PIPELINE_BLAS=reference")
        return None
    if "mlx.core" in sys.modules:
        STATE = BlasState(active=False, name=reference, expected=True,
                          reason="mlx.core was imported before pipeline; import pipeline first")
        return None
    try:
        lib, path = _open_scipy_openblas()
        machine = _ELF_MACHINE.get(platform.machine().lower())
        if machine is None or struct.calcsize("P") != 8:
            raise OSError(f"no ELF alias table for {platform.machine()} ({8 * struct.calcsize('P')}-bit)")
        targets = {n: _address(lib, "scipy_" + n) for n in ROUTINES}
        targets = {n: a for n, a in targets.items() if a}
        if "cblas_sgemm" not in targets:
            raise OSError(f"{path} has no scipy_cblas_sgemm")
        forward = None
        if machine == 62 and targets.get("cblas_sgemv") and os.environ.get("PIPELINE_GEMV_FORWARD") != "0":
            forward = gemv_forward(targets["cblas_sgemm"], targets["cblas_sgemv"])
            if forward is not None:
                targets["cblas_sgemm"] = forward
        alias = _load_alias_library(alias_elf(targets, machine))
        bound = {n: _address(ctypes.CDLL(None), n) for n in targets}
        wrong = [n for n, a in targets.items() if bound[n] != a]
        if wrong or _address(alias, "cblas_sgemm") != targets["cblas_sgemm"]:
            raise OSError(f"the dynamic linker did not bind {', '.join(wrong or ['cblas_sgemm'])} to OpenBLAS")
    except (OSError, ImportError, AttributeError, IndexError) as e:
        STATE = BlasState(active=False, name=reference, expected=True, reason=f"OpenBLAS did not load: {e}")
        return None
    _LIB, LOADED = lib, path
    STATE = BlasState(active=True, name=_name(), core=_text(lib, "scipy_openblas_get_corename"),
                      threads=lib.scipy_openblas_get_num_threads(), path=path, expected=True,
                      gemv_forward=forward is not None)
    return LOADED


def warn_if_slow() -> None:
    """Log one warning per process when the fast CPU path is promised here but not active: what is
    missing, what it costs and the fix."""
    global _warned
    if _warned or not STATE.expected or STATE.active:
        return
    _warned = True
    log.warning("%s; MLX's CPU matmuls run on the reference BLAS bundled with mlx, about 5x slower "
                "(the main job: 3.3 vs 16.0 tok/s on a 2-core x86_64 CPU); fix: %s", STATE.reason, _FIX)


def gemv_forward(sgemm: int, sgemv: int) -> int | None:
    """An executable copy of ``_GEMV_FORWARD_X86_64`` jumping to ``sgemm`` and ``sgemv`` (CBLAS entry points'
    addresses), checked against ``sgemm`` itself; returns its address, or None where Linux refuses executable
    memory or the check fails (then MLX calls sgemm directly, as before). x86-64 only."""
    import mmap

    code = bytearray(_GEMV_FORWARD_X86_64)
    code[_SGEMV_IMM:_SGEMV_IMM + 8] = struct.pack("<Q", sgemv)
    code[_SGEMM_IMM:_SGEMM_IMM + 8] = struct.pack("<Q", sgemm)
    try:
        page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        page.write(bytes(code))
        address = ctypes.addressof(ctypes.c_char.from_buffer(page))
        libc = ctypes.CDLL(None)
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        if libc.mprotect(address, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_EXEC) != 0:
            return None
    except (OSError, ValueError, AttributeError):
        return None
    if not _forward_matches(address, sgemm):
        return None
    _CODE.append(page)  # bound as cblas_sgemm from here on: the page lives as long as the process
    return address


_SGEMM = ctypes.CFUNCTYPE(None, *[ctypes.c_int] * 6, ctypes.c_float, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                          ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_int)


def _forward_matches(forward: int, sgemm: int) -> bool:
    """The forwarder gives sgemm's products (to float32 rounding; sgemv sums in its own order) on single rows of
    both layouts of B, with beta 0 over a C of NaNs (MLX's output buffers are not initialized), with alpha and
    beta, and passes a two-row product to sgemm bit for bit. Plain Python lists, no NumPy."""
    ours, theirs = _SGEMM(forward), _SGEMM(sgemm)
    k, n = 5, 7
    a = [0.5 + 0.25 * i for i in range(2 * k)]
    b = [((3 * i) % 11 - 5) / 4 for i in range(k * n)]
    cases = [  # trans_b, m, alpha, beta, C's start value
        (112, 1, 1.0, 0.0, float("nan")), (111, 1, 1.0, 0.0, float("nan")), (112, 1, 2.0, 0.5, 1.5),
        (111, 1, -1.0, 0.5, 1.5), (112, 2, 1.0, 0.0, 0.0)]
    for trans_b, m, alpha, beta, start in cases:
        ldb = k if trans_b == 112 else n
        out = []
        for fn in (ours, theirs):
            fa, fb = (ctypes.c_float * len(a))(*a), (ctypes.c_float * len(b))(*b)
            c = (ctypes.c_float * (m * n))(*[start] * (m * n))
            fn(101, 111, trans_b, m, n, k, alpha, ctypes.addressof(fa), k, ctypes.addressof(fb), ldb, beta,
               ctypes.addressof(c), n)
            out.append(list(c))
        got, want = out
        if m > 1 and got != want:
            return False
        if any(not abs(g - w) <= 1e-5 * (1 + abs(w)) for g, w in zip(got, want)):  # NaN fails too
            return False
    return True


def _open_scipy_openblas():
    import scipy_openblas32

    lib_dir = scipy_openblas32.get_lib_dir()
    path = os.path.join(lib_dir, scipy_openblas32.get_library(fullname=True))
    return ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL), path


def _address(lib, name: str) -> int:
    try:
        return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value or 0
    except AttributeError:
        return 0


def _text(lib, name: str) -> str | None:
    fn = getattr(lib, name, None)
    if fn is None:
        return None
    fn.restype = ctypes.c_char_p
    return fn().decode().strip()


def _name() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"OpenBLAS from scipy-openblas32 {version('scipy-openblas32')}"
    except PackageNotFoundError:
        return "OpenBLAS from scipy-openblas32"


def _load_alias_library(image: bytes):
    """dlopen ``image`` with ``RTLD_GLOBAL``: from an anonymous memory file where Linux has one (nothing
    written to disk), else from a temporary file removed once loaded."""
    try:
        fd = os.memfd_create("pipeline-blas-alias")
    except (AttributeError, OSError):
        fd = None
    if fd is not None:
        try:
            os.write(fd, image)
            return ctypes.CDLL(f"/proc/self/fd/{fd}", mode=ctypes.RTLD_GLOBAL)
        except OSError:
            pass  # /proc not mounted: fall back to a file
        finally:
            os.close(fd)
    import tempfile

    with tempfile.NamedTemporaryFile(prefix="pipeline-blas-alias-", suffix=".so") as f:
        f.write(image)
        f.flush()
        return ctypes.CDLL(f.name, mode=ctypes.RTLD_GLOBAL)


def _elf_hash(name: bytes) -> int:
    """The System V ABI's ELF symbol hash (gABI, "Hash Table")."""
    h = 0
    for c in name:
        h = ((h << 4) + c) & 0xFFFFFFFF
        g = h & 0xF0000000
        if g:
            h ^= g >> 24
        h &= ~g & 0xFFFFFFFF
    return h


def alias_elf(symbols: dict[str, int], machine: int, soname: str = "libpipeline-blas-alias.so") -> bytes:
    """An ELF64 little-endian shared object that defines each ``symbols`` name as an absolute function
    symbol (``STT_FUNC``, ``SHN_ABS``) with the given address, and nothing else.

    Layout (gABI): ELF header; program headers PT_LOAD (the whole file), PT_DYNAMIC and PT_GNU_STACK
    (non-executable stack: glibc >= 2.41 refuses to dlopen an object without one); .dynsym; a System V
    .hash; .dynstr; .dynamic (DT_STRTAB, DT_SYMTAB, DT_STRSZ, DT_SYMENT, DT_HASH, DT_SONAME, DT_NULL).

    Args:
        symbols: symbol name -> absolute address in this process.
        machine: ``e_machine`` (62 x86-64, 183 AArch64).
    """
    names = list(symbols)
    strtab = b"\0" + soname.encode() + b"\0"
    offsets = []
    for n in names:
        offsets.append(len(strtab))
        strtab += n.encode() + b"\0"
    nsym = len(names) + 1
    dynsym = bytes(24) + b"".join(struct.pack("<IBBHQQ", off, (1 << 4) | 2, 0, 0xFFF1, symbols[n], 0)
                                  for n, off in zip(names, offsets))  # STB_GLOBAL, STT_FUNC, SHN_ABS
    nbucket = max(1, len(names))
    buckets, chains = [0] * nbucket, [0] * nsym
    for i, n in enumerate(names, 1):
        b = _elf_hash(n.encode()) % nbucket
        chains[i], buckets[b] = buckets[b], i
    hashtab = struct.pack(f"<II{nbucket}I{nsym}I", nbucket, nsym, *buckets, *chains)

    def up(x: int) -> int:
        return (x + 7) // 8 * 8

    sym_off = 64 + 3 * 56
    hash_off = up(sym_off + len(dynsym))
    str_off = up(hash_off + len(hashtab))
    dyn_off = up(str_off + len(strtab))
    dynamic = b"".join(struct.pack("<qQ", tag, value) for tag, value in
                       [(5, str_off), (6, sym_off), (10, len(strtab)), (11, 24), (4, hash_off), (14, 1), (0, 0)])
    size = dyn_off + len(dynamic)
    header = (b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)  # ELFCLASS64, ELFDATA2LSB, EV_CURRENT, System V ABI
              + struct.pack("<HHIQQQIHHHHHH", 3, machine, 1, 0, 64, 0, 0, 64, 56, 3, 64, 0, 0))  # ET_DYN
    phdrs = (struct.pack("<IIQQQQQQ", 1, 6, 0, 0, 0, size, size, 0x1000)  # PT_LOAD, read/write
             + struct.pack("<IIQQQQQQ", 2, 6, dyn_off, dyn_off, dyn_off, len(dynamic), len(dynamic), 8)
             + struct.pack("<IIQQQQQQ", 0x6474E551, 6, 0, 0, 0, 0, 0, 16))  # PT_GNU_STACK, read/write
    image = bytearray(size)
    for off, part in ((0, header), (64, phdrs), (sym_off, dynsym), (hash_off, hashtab), (str_off, strtab),
                      (dyn_off, dynamic)):
        image[off:off + len(part)] = part
    return bytes(image)
