// Package archtest holds tests of rules about the module's layout that the
// compiler does not check; `make unit-test` runs them with every other
// package's tests.
package archtest
