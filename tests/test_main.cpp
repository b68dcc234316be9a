// Catch2's main in its own translation unit so it compiles once.
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
