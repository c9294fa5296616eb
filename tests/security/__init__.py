"""Adversarial tests of issue 12: each way around a limit, proven closed."""
