"""The Deep Think tab: voting over sampled traces (`tab`) and its calibration panel (`calibration`)."""
