fn main() {
    println!("I am not a volagent backend");
}
