"""Losses and advantages: pure functions of rows and rewards, and the loss config."""
