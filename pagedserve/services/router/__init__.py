"""The fleet router: sends each request to the pod that holds the longest part of its prefix, weighed against load."""
