"""Times ways of getting GiBs of page-locked host memory mapped for the GPU (the host copy of a
decoded dataset): cudaHostAlloc (torch pin_memory), an anonymous mmap faulted by N threads then
cudaHostRegister, and mmap with MAP_POPULATE then cudaHostRegister. With --copy, also the rate of
device-to-host copies of 64 MiB into each kind (the fill of a host copy wrote at about 20 GB/s in
run 161, against 55 GB/s host to device). One JSON line per way."""
import argparse, ctypes, json, mmap, threading, time

import cupy

p = argparse.ArgumentParser()
p.add_argument("--gib", type=float, default=4)
p.add_argument("--threads", default="1,8,16")
p.add_argument("--copy", action="store_true", help="also time device-to-host copies into each kind")
a = p.parse_args()
n = int(a.gib * (1 << 30))
libc = ctypes.CDLL("libc.so.6", use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
PROT_RW, MAP_PRIV_ANON, MAP_POPULATE, MADV_HUGEPAGE = 3, 0x22, 0x8000, 14
cupy.cuda.runtime.free(cupy.cuda.runtime.malloc(1))


def out(way, **kw):
    print(json.dumps(dict(way=way, gib=a.gib, **kw)), flush=True)


def d2h_rate(ptr, chunk=64 << 20, rounds=2):
    """GB/s of device-to-host copies of `chunk` bytes into the n bytes at ptr, on one stream."""
    src = cupy.cuda.runtime.malloc(chunk)
    stream = cupy.cuda.Stream(non_blocking=True)
    stream.synchronize()
    t = time.perf_counter()
    for _ in range(rounds):
        for off in range(0, n - chunk + 1, chunk):
            cupy.cuda.runtime.memcpyAsync(ptr + off, src, chunk, 2, stream.ptr)  # DtoH
    stream.synchronize()
    seconds = time.perf_counter() - t
    cupy.cuda.runtime.free(src)
    return rounds * (n // chunk) * chunk / seconds / 1e9


def register(ptr, rates=None):
    t = time.perf_counter()
    cupy.cuda.runtime.hostRegister(ptr, n, 2 | 1)  # DEVICEMAP | PORTABLE
    r = time.perf_counter() - t
    if rates is not None:
        rates.append(d2h_rate(ptr))
    t = time.perf_counter()
    cupy.cuda.runtime.hostUnregister(ptr)
    return r, time.perf_counter() - t


t = time.perf_counter()
ptr = cupy.cuda.runtime.hostAlloc(n, 2 | 1)
alloc = time.perf_counter() - t
rate = d2h_rate(ptr) if a.copy else None
t = time.perf_counter()
cupy.cuda.runtime.freeHost(ptr)
out("cudaHostAlloc", seconds=alloc, free_s=time.perf_counter() - t, d2h_gb_per_s=rate)

for huge in (False, True):
    for threads in [int(x) for x in a.threads.split(",")]:
        t0 = time.perf_counter()
        ptr = libc.mmap(None, n, PROT_RW, MAP_PRIV_ANON, -1, 0)
        if huge:
            libc.madvise(ptr, n, MADV_HUGEPAGE)
        chunk = (n + threads - 1) // threads
        buf = (ctypes.c_char * n).from_address(ptr)

        def touch(lo, hi):
            ctypes.memset(ptr + lo, 0, hi - lo)

        ts = [threading.Thread(target=touch, args=(i * chunk, min(n, (i + 1) * chunk))) for i in range(threads)]
        [x.start() for x in ts]
        [x.join() for x in ts]
        fault = time.perf_counter() - t0
        rates = [] if a.copy else None
        reg, unreg = register(ptr, rates)
        libc.munmap(ptr, n)
        out("mmap+memset threads+register", huge=huge, threads=threads, fault_s=fault, register_s=reg,
            unregister_s=unreg, total_s=fault + reg, d2h_gb_per_s=rates[0] if rates else None)

for huge in (False,):
    t0 = time.perf_counter()
    ptr = libc.mmap(None, n, PROT_RW, MAP_PRIV_ANON | MAP_POPULATE, -1, 0)
    fault = time.perf_counter() - t0
    reg, unreg = register(ptr)
    libc.munmap(ptr, n)
    out("mmap MAP_POPULATE+register", fault_s=fault, register_s=reg, unregister_s=unreg, total_s=fault + reg)

t0 = time.perf_counter()
ptr = libc.mmap(None, n, PROT_RW, MAP_PRIV_ANON, -1, 0)
reg, unreg = register(ptr)
libc.munmap(ptr, n)
out("mmap (untouched)+register", register_s=reg, unregister_s=unreg, total_s=time.perf_counter() - t0)
print(open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip())
