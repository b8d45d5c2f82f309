"""Serving: SGLang's launch command, and the process supervisor used where systemd is absent."""
