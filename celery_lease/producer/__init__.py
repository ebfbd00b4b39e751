"""The producer side: submitting leased tasks, their stored message, publishing."""
