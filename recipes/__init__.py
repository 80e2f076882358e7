"""Training recipes built on commopt's public API (ResNet-50 on ImageNet, digits parity, scaling)."""
