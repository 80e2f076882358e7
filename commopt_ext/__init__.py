"""Native kernels for commopt. Never imports commopt; commopt/kernels.py loads these."""
