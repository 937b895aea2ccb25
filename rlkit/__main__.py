from rlkit.train import main

main()
