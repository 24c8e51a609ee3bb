"""Keras callbacks for distributed training."""
from kerasdist.callbacks.trust_ratio_logger import TrustRatioLogger
