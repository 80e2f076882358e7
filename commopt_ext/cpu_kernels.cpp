// Native CPU kernels for commopt (C ABI, loaded through ctypes by commopt/kernels.py).
extern "C" int commopt_abi_version() { return 1; }
