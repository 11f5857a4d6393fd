"""`python -m gpufeed ...` runs the bundled `gpufeed` command, as the console script does."""

from gpufeed._cli import main

main()
