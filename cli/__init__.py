"""Command-line front ends. The only code in the project that prints or exits."""
