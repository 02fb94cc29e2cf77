"""``k3serve sim``: a fleet simulator over the project's own routing and prefix-cache code (docs/traffic.md)."""
