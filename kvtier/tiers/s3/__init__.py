"""The S3 tier (``tier.S3Tier``, kind ``s3``) and its parts: ``config``,
``client``, ``reads``, ``writes``, ``collect``, ``presigned`` (reads as
plain HTTP requests), ``lease`` (the collector's lease object), ``journal``
(the removal journal). Importing it imports no boto3."""
