"""Winning config -> engine args -> Kubernetes objects -> validation -> apply. Imports no ML packages."""
