"""What a run reports: metrics, console lines, plots, profiles."""
