"""ResNet-50 on ImageNet (or synthetic data) with commopt: ``python -m recipes.resnet50.train``."""
