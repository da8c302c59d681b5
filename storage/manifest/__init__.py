"""The manifest: the record that makes a checkpoint step exist, and its checks."""
