"""The brain: job metrics in a database and resource plans for the master."""
